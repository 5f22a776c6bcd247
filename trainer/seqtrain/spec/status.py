"""The job's `.status` (custom resource) and `status.json` (local runs): one model for both."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
)
from pydantic.alias_generators import to_camel

Phase = Literal["Pending", "Scheduling", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})


class _StatusModel(BaseModel):
    # Status is written by us, read back by us: unknown keys are kept, not rejected, so an older operator
    # never loses what a newer one wrote.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")


class Condition(_StatusModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class Layout(_StatusModel):
    dp: int = 1
    tp: int = 1
    pp: int = 1


class ReplicaPlacement(_StatusModel):
    replica: int
    node: str
    ranks: list[int] = Field(default_factory=list)
    domain: list[str] = Field(default_factory=list, description="Topology domain of the node (values of "
                              "scheduling.topology.keys, outermost first) as the native placement planned it.")


class Progress(_StatusModel):
    step: int = 0
    total_steps: int = 0
    # JSONPath cannot concatenate, so the Step and ETA printer columns read these texts; derived from step,
    # totalSteps and etaSeconds on every dump (the serializer below), never set by hand.
    step_display: str | None = Field(None, description="`step/totalSteps` (the Step printer column).")
    eta_display: str | None = Field(None, description="etaSeconds as a duration, e.g. 4m10s (the ETA printer column).")
    percent: float | None = Field(None, description="step / totalSteps, in percent (one decimal).")
    eta_seconds: float | None = Field(None, description="Seconds until totalSteps at the wall time per step of this "
                                      "attempt's recent steps (checkpoint saves and evaluations included, restarts "
                                      "and start-up not); null until this attempt has completed two steps.")
    loss: float | None = Field(None, description="Training loss of the last step; null when it was not a finite "
                               "number (then lossNonFinite is true).")
    loss_non_finite: bool | None = Field(None, description="True when the last step's loss was NaN, Infinity or "
                                         "beyond 1e9: the run is diverging.")
    non_finite_steps: int | None = Field(None, description="Steps of this trainer process whose loss was not "
                                         "finite.")
    tokens_per_second: float | None = Field(None, description="Tokens trained per second of training, averaged "
                                            "over the run (every kept step, across restarts).")
    last_tokens_per_second: float | None = Field(None, description="Tokens per second of the last step alone.")
    updated_at: str | None = None
    mfu: float | None = Field(None, description="Model FLOPs utilisation (0..1) of the last step; absent on CPU.")
    val_loss: float | None = Field(None, description="Validation loss of the last evaluation.")
    val_perplexity: float | None = Field(None, description="exp(valLoss) of the last evaluation.")
    val_bits_per_byte: float | None = Field(None, description="Validation bits per byte (byte-level data only).")
    best_val_loss: float | None = Field(None, description="Lowest validation loss so far.")
    best_step: int | None = Field(None, description="Step of the lowest validation loss (its checkpoint is kept).")
    stop_reason: str | None = Field(None, description="Why training ended before training.steps, e.g. EarlyStopped.")
    stop_message: str | None = Field(None, description="Human-readable detail of stopReason.")
    attempt: int | None = Field(None, description="The gang attempt whose trainer reported this progress.")
    micro_batch_size: int | None = Field(None, description="training.microBatchSize: auto: the size the trainer "
                                         "chose (its probe steps confirmed it); null otherwise.")
    micro_batch_reason: str | None = Field(None, description="Why auto chose microBatchSize, e.g. `microBatchSize "
                                           "auto -> 8, gradient accumulation 2 (16 does not fit: ...)`.")
    training_started_at: str | None = Field(None, description="When this attempt's trainer began its first step "
                                            "(start-up and restart time end here).")
    checkpoint_seconds: float | None = Field(None, description="Time this attempt's training loop was blocked on "
                                             "checkpoint saves so far.")
    step_seconds: float | None = Field(None, description="Mean wall time of one optimizer step in this attempt "
                                       "(prices the steps redone after a restart).")
    step_reached_before: int | None = Field(None, description="The highest step trained before this trainer "
                                            "resumed (its metrics.jsonl): the steps it redoes are those past its "
                                            "checkpoint up to here.")
    resumed_from: int | None = Field(None, description="The checkpoint step this trainer resumed from (None: it "
                                     "started from scratch): with stepReachedBefore, the steps it redoes.")
    restart_round: int | None = Field(None, description="In-place restarts of that incarnation so far (0: its first "
                                      "start).")

    @model_serializer(mode="wrap")
    def _with_displays(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        out = handler(self)
        step, eta = ("stepDisplay", "etaDisplay") if info.by_alias else ("step_display", "eta_display")
        out[step] = f"{self.step}/{self.total_steps}" if self.total_steps else str(self.step)
        out.pop(eta, None)
        if self.eta_seconds is not None and math.isfinite(self.eta_seconds) and self.eta_seconds >= 0:
            out[eta] = short_duration(self.eta_seconds)
        return out


class CheckpointRef(_StatusModel):
    step: int
    path: str
    time: str | None = None


class LostSeconds(_StatusModel):
    """Where the wall time that did not train went (controller/lost_time.py): productiveSeconds plus these add up
    to the job's wall time from its creation (to its completion), and goodput = productiveSeconds / that sum."""

    queueing: float = Field(0.0, description="Created (or re-planned) until the gang was admitted and placed.")
    startup: float = Field(0.0, description="Gang created until its trainer began the first step.")
    checkpoint_stall: float = Field(0.0, description="Training blocked on checkpoint saves.")
    restart: float = Field(0.0, description="From a failure (the last step before it) until training resumed.")
    recomputed: float = Field(0.0, description="Steps redone after restarts (checkpoint to failure), at the "
                              "measured step time.")
    suspended: float = Field(0.0, description="Time suspended (spec.suspend, or an interrupted local run).")


class TimeLedger(_StatusModel):
    """Bookkeeping of the lost-time accounting: wall time up to `at` is attributed; `state` says where the time
    since then goes."""

    at: str
    state: Literal["queueing", "startup", "restart", "training", "suspended", "done"] = "queueing"
    attempt: int = 0
    checkpoint_seconds: float = Field(0.0, description="checkpointSeconds of `attempt` already charged.")
    trainer_started_at: str | None = Field(None, description="trainingStartedAt of the trainer process whose "
                                           "checkpointSeconds were charged.")
    recompute_pending_steps: int = Field(0, description="Steps redone after a restart not yet charged to "
                                         "`recomputed` (no step time known yet).")


class CheckpointPolicy(_StatusModel):
    """The checkpoint interval in force and its inputs, as rank 0 last computed them (seqtrain.train.interval)."""

    interval_steps: int | None = Field(None, description="Steps between checkpoints now.")
    interval_seconds: float | None = Field(None, description="checkpoint.intervalSeconds, when the user set it.")
    save_seconds: float | None = Field(None, description="What one save blocks training for.")
    mtbf_seconds: float | None = Field(None, description="Mean time between failures of the whole gang.")
    step_seconds: float | None = Field(None, description="Recent time of one optimizer step.")
    failures: int = Field(0, description="Gang restarts seen (failures and infrastructure) before this attempt.")
    exposure_seconds: float = Field(0.0, description="Training time the failures were seen in (all attempts).")
    sources: dict[str, str] = Field(
        default_factory=dict, description="Where each figure came from: intervalSteps: user | youngDaly | "
        "firstSave | minIntervalSteps | maxIntervalSteps; saveSeconds: measured | checkpoint (the previous attempt's "
        "save); mtbfSeconds: measured (the job's failures) | prior (the cluster's MTBF per rank, no failure yet).")


class WorkAtRisk(_StatusModel):
    """What a failure now would lose: the training since the latest complete checkpoint."""

    checkpoint_step: int = Field(0, description="Step of the latest complete checkpoint (0: none).")
    steps: int = Field(0, description="Steps trained since it.")
    seconds: float = Field(0.0, description="Training seconds since it (this attempt's share).")
    checkpoint_age_seconds: float | None = Field(None, description="Wall seconds since it was saved.")


class JobStatus(_StatusModel):
    phase: Phase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    restarts: int = Field(0, description="Gang restarts caused by failures of the training itself.")
    infra_restarts: int = Field(0, description="Gang restarts caused by infrastructure (eviction, node loss).")
    replicas: int | None = Field(None, description="Replicas the current attempt runs: spec.replicas, or fewer "
                                 "for an elastic gang (spec.minReplicas) while the full gang does not fit.")
    world_size: int | None = Field(None, description="Rank processes of the current attempt (replicas x "
                                   "processesPerReplica).")
    layout: Layout | None = None
    placement: list[ReplicaPlacement] = Field(default_factory=list)
    progress: Progress | None = None
    last_checkpoint: CheckpointRef | None = None
    start_time: str | None = None
    completion_time: str | None = None
    message: str = ""
    attempt: int = Field(0, description="Gang incarnation counter (1 for the first start).")
    restart_round: int = Field(0, description="In-place restarts of the current incarnation counted so far.")
    in_place_restarts: int = Field(0, description="Of `restarts`, those done in place (ranks restarted in the "
                                   "existing pods, not a re-created gang).")
    next_restart_time: str | None = Field(None, description="When a pending restart may start (backoff).")
    failed_nodes: dict[str, str] = Field(default_factory=dict, description="node -> time until which it is avoided.")
    steps_lost: list[int] = Field(default_factory=list, description="Steps redone after each restart.")
    goodput: float | None = Field(None, description="productiveSeconds / wall time since the job was created "
                                  "(productiveSeconds + the sum of lostSeconds).")
    running_seconds: float = Field(0.0, description="Time the gang spent Running in segments that already ended "
                                   "(the current segment runs from the Running condition).")
    lost_seconds: LostSeconds | None = Field(None, description="Wall time that did not train, by reason.")
    productive_seconds: float | None = Field(None, description="Wall time that trained steps that were kept "
                                             "(goodput's numerator).")
    time_ledger: TimeLedger | None = Field(None, description="Bookkeeping of lostSeconds (internal).")
    observed_generation: int | None = Field(None, description="metadata.generation of the spec this status was "
                                            "computed from.")
    create_failures: int = Field(0, description="Consecutive gang creations the API server refused part-way "
                                 "(quota, admission); retried with backoff, reset once a gang runs.")
    skipped_checkpoints: dict[str, str] = Field(
        default_factory=dict, description="Checkpoint step -> why the trainer set it aside and resumed from an "
        "earlier one (a file refused as unsafe, truncated or unreadable).")
    checkpoint_policy: CheckpointPolicy | None = Field(
        None, description="The checkpoint interval in force and where its inputs came from.")
    work_at_risk: WorkAtRisk | None = Field(None, description="Work a failure now would lose (since the latest "
                                            "checkpoint): what a preemption should prefer to spare.")
    attempt_start_time: str | None = Field(None, description="When the current attempt's gang was created.")
    startup_failure: str | None = Field(
        None, description="Signature (exit code and error) of the last attempt when it failed before its first "
        "step; the next attempt failing the same way fails the job (a deterministic start-up failure).")

    def to_dict(self) -> dict:
        """The status as written (CR `.status`, status.json): JSON-safe, a non-finite figure written as null, since
        the API server refuses a bare NaN and a refused status write would leave the job's restarts and end
        unrecorded."""
        return json_safe(self.model_dump(by_alias=True, mode="json", exclude_none=True))


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, +-Infinity) replaced by None, so that `json.dumps(...,
    allow_nan=False)` takes it: what seqtrain writes is JSON (RFC 8259 has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def short_duration(seconds: float) -> str:
    """kubectl's short durations: 45s, 3m12s (under 10 minutes), 12m, 2h5m, 3d4h."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s < 600 and s % 60 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60}m" if (s % 3600) // 60 else f"{s // 3600}h"
    return f"{s // 86400}d{(s % 86400) // 3600}h" if (s % 86400) // 3600 else f"{s // 86400}d"
