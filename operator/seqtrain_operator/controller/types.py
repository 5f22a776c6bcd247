"""Inputs and outputs of the controller core: what a backend observed, and what it must do next.

All plain frozen dataclasses, no I/O. A backend (local processes or Kubernetes pods) builds an `Observed` from the
world, calls `decide()`, executes the returned actions in order, and persists `Decision.status`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from seqtrain.spec.status import CheckpointPolicy, CheckpointRef, JobStatus, Progress, WorkAtRisk
from seqtrain_operator.planner.types import Node, Plan

ReplicaPhase = Literal["Pending", "Running", "Succeeded", "Failed"]


@dataclass(frozen=True)
class ReplicaObservation:
    """One replica of the gang (a pod, or a local group of rank processes) as the backend sees it.

    replica: index 0..replicas-1. attempt: the gang incarnation the replica belongs to (a label on the pod / the
    attempt the local runner started it with). phase: Pending (created, not all ranks started), Running,
    Succeeded (every rank exited 0), Failed (any rank exited non-zero or the replica vanished).
    exit_code: the replica's exit code (128+N for signal N), or 0 / None: a pod's container code, or the local replica
    process's, both `seqtrain.runtime.launch.replica_exit_code` of its ranks; the controller reads only this.
    reason: what the backend knows beyond the code: OOMKilled, Evicted, Preempted, NodeLost, Deleted, Signal ...
    node: where it runs (None while unscheduled). message: free text for the status/event.
    terminating: the object is being deleted (deletionTimestamp set), by us or by someone else.
    node_lost: its node has been NotReady/unreachable (or removed) for longer than the backend's grace period:
    no kubelet will ever confirm its deletion, so deleting it must be forced.
    node_unready: its node is not Ready right now (for any time; node_lost once past the grace period).
    overdue: terminating on a Ready node well past its deletion deadline (the grace period), with no finalizer
    holding it: its kubelet did not confirm, so deleting it must be forced.
    finished_at: when it terminated (ISO-8601; None while it runs or when the backend cannot tell).
    error: the one-line error the failing rank reported (`seqtrain train: error: ...`, read from its log or the
    pod's termination message), None when it reported none; the controller compares it across attempts.
    queued: waiting in an external gang scheduler's queue (e.g. gated by Kueue until its Workload is admitted):
    not stuck, so scheduling.pendingGraceSeconds does not tear the gang down.
    restart_round: the in-place restarts its launcher reported making when it exited (seqtrain.runtime.restart);
    0 while it runs (rank 0's progress reports the round then).
    placed_at: when it was placed on its node (ISO-8601; None when the backend cannot tell).
    rank: the rank whose exit ended the replica (of several: the first its launcher reported), None when the
    backend cannot tell; the failure's message names it.
    """

    replica: int
    attempt: int
    phase: ReplicaPhase
    exit_code: int | None = None
    reason: str | None = None
    node: str | None = None
    message: str = ""
    terminating: bool = False
    node_lost: bool = False
    node_unready: bool = False
    overdue: bool = False
    finished_at: str | None = None
    error: str | None = None
    queued: bool = False
    restart_round: int = 0
    placed_at: str | None = None
    rank: int | None = None


@dataclass(frozen=True)
class Observed:
    """The gang and its surroundings as the backend saw them at one moment.

    replicas: every replica object that exists, of any attempt (empty: no gang exists). A backend must list replicas
    that are still being deleted too, so the core never creates a second gang next to a dying one.
    latest_checkpoint: the highest COMPLETE checkpoint (step-N with meta.json), or None.
    progress: the trainer's latest step/loss/throughput (updated_at = time of the last completed step, ISO-8601).
    unschedulable: set by the backend when the gang cannot be admitted for a reason of its own (an external gang
    scheduler that is not installed); the text is shown in the Scheduled condition.
    capacity: the free capacity of every node (after the requests of every pod bound or pinned to it), when the
    core itself places the gang (native gang scheduling on Kubernetes); None: the backend places it (local runs,
    external gang schedulers). Read only when a gang is to be created, and while an elastic gang runs below its size
    (can it grow back?); it must leave out this job's own pods.
    progress_unreachable: why the backend could not read the trainer's progress (e.g. the progress endpoint did not
    answer: a NetworkPolicy, a service mesh, an operator outside the cluster); None: it could, or it does not try.
    Hang detection then says ProgressUnknown instead of failing a job that may be healthy.
    generation: metadata.generation of the spec the backend read (status.observedGeneration).
    unschedulable: set by the backend when the planner cannot place the whole gang now (gang admission refused);
    the text is shown in the Scheduled condition.
    skipped_checkpoints: (step, reason) of checkpoints the trainer set aside as unusable (a refused or corrupt file);
    each is reported once with a Warning event.
    created: when the job was created (the custom resource's creationTimestamp); None: the first pass is its
    creation (a local run). Lost-time accounting starts there.
    checkpoint_policy / work_at_risk: the trainer's `checkpointPolicy` and `workAtRisk` (None: not reported now).
    progress_source: where `progress` came from ("pushed" by rank 0, "polled" from it; None: neither, or the
    termination message), named in the Progressing condition.
    autoscaler: the cluster has a node autoscaler (the operator's --autoscale): a native gang that does not fit is
    created unpinned unless its spec.scheduling.autoscale is false.
    """

    replicas: tuple[ReplicaObservation, ...] = ()
    latest_checkpoint: CheckpointRef | None = None
    progress: Progress | None = None
    unschedulable: str | None = None
    capacity: tuple[Node, ...] | None = None
    progress_unreachable: str | None = None
    generation: int | None = None
    skipped_checkpoints: tuple[tuple[int, str], ...] = ()
    created: str | None = None
    checkpoint_policy: CheckpointPolicy | None = None
    work_at_risk: WorkAtRisk | None = None
    autoscaler: bool = False
    progress_source: str | None = None


# ---- actions: executed by the backend in the order given ----------------------------------------------------------


@dataclass(frozen=True)
class CreateGang:
    """Start every replica of incarnation `attempt` together (all or none). Ranks resume from the latest complete
    checkpoint by themselves; resume_from_step is the step the core expects (None: from scratch), for logs/events.
    avoid_nodes: nodes that failed recently (placement should skip them while others fit).
    plan: where each replica goes, when the core placed the gang (Observed.capacity given); None: the backend's
    scheduler places it.
    replicas: how many replicas this attempt runs when not spec.replicas (an elastic gang admitted smaller: build
    the gang from `job.with_replicas(replicas)`); None: spec.replicas.
    in_place_delays: the backoff of each in-place restart this gang may make (seqtrain.runtime.restart: the
    launchers get it as SEQTRAIN_INPLACE_DELAYS); () for none: a failure re-creates the gang."""

    attempt: int
    resume_from_step: int | None = None
    avoid_nodes: tuple[str, ...] = ()
    plan: Plan | None = None
    replicas: int | None = None
    in_place_delays: tuple[float, ...] = ()


@dataclass(frozen=True)
class DeleteGang:
    """Stop and remove every replica of `attempt` (graceful: SIGTERM, the trainer saves, then SIGKILL after a
    deadline). Idempotent: the core repeats it while replicas of that attempt are still observed.
    force_nodes: nodes lost for good (no kubelet will confirm a graceful deletion): pods of this attempt there are
    deleted with gracePeriodSeconds 0, otherwise their deletionTimestamp stays forever and no new gang can start."""

    attempt: int
    reason: str
    force_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RequeueAfter:
    """Call decide() again after this many seconds even if nothing changes (backoff, scheduling waits)."""

    seconds: float


@dataclass(frozen=True)
class Event:
    """A Kubernetes-style event (Normal/Warning). Emit it only after the status write succeeded."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class DeleteJob:
    """Delete the job itself (spec.ttlSecondsAfterFinished passed); its children go with it (ownerReferences).
    The local backend has no job object and ignores it."""

    reason: str


Action = CreateGang | DeleteGang | RequeueAfter | Event | DeleteJob


@dataclass(frozen=True)
class Decision:
    """What to do (in order) and the status to persist (a new object; the input status is never mutated)."""

    actions: tuple[Action, ...]
    status: JobStatus
    notes: tuple[str, ...] = field(default=())

    def of(self, kind: type) -> list:
        """The actions of one type, e.g. `decision.of(CreateGang)`."""
        return [a for a in self.actions if isinstance(a, kind)]
