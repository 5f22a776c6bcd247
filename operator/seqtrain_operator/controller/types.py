"""Inputs and outputs of the controller core: what a backend observed, and what it must do next.

All plain frozen dataclasses, no I/O. A backend (local processes or Kubernetes pods) builds an `Observed` from the
world, calls `decide()`, executes the returned actions in order, and persists `Decision.status`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from seqtrain.spec.status import CheckpointRef, JobStatus, Progress

ReplicaPhase = Literal["Pending", "Running", "Succeeded", "Failed"]


@dataclass(frozen=True)
class ReplicaObservation:
    """One replica of the gang (a pod, or a local group of rank processes) as the backend sees it.

    replica: index 0..replicas-1. attempt: the gang incarnation the replica belongs to (a label on the pod / the
    attempt the local runner started it with). phase: Pending (created, not all ranks started), Running,
    Succeeded (every rank exited 0), Failed (any rank exited non-zero or the replica vanished).
    exit_code: the first non-zero exit code of a rank (128+N for signal N), or 0 / None.
    reason: what the backend knows beyond the code: OOMKilled, Evicted, Preempted, NodeLost, Deleted, Signal ...
    node: where it runs (None while unscheduled). message: free text for the status/event.
    queued: waiting in an external gang scheduler's queue (e.g. gated by Kueue until its Workload is admitted):
    not stuck, so scheduling.pendingGraceSeconds does not tear the gang down.
    """

    replica: int
    attempt: int
    phase: ReplicaPhase
    exit_code: int | None = None
    reason: str | None = None
    node: str | None = None
    message: str = ""
    queued: bool = False


@dataclass(frozen=True)
class Observed:
    """The gang and its surroundings as the backend saw them at one moment.

    replicas: every replica object that exists, of any attempt (empty: no gang exists). A backend must list replicas
    that are still being deleted too, so the core never creates a second gang next to a dying one.
    latest_checkpoint: the highest COMPLETE checkpoint (step-N with meta.json), or None.
    progress: the trainer's latest step/loss/throughput (updated_at = time of the last completed step, ISO-8601).
    unschedulable: set by the backend when the planner cannot place the whole gang now (gang admission refused);
    the text is shown in the Scheduled condition.
    """

    replicas: tuple[ReplicaObservation, ...] = ()
    latest_checkpoint: CheckpointRef | None = None
    progress: Progress | None = None
    unschedulable: str | None = None


# ---- actions: executed by the backend in the order given ----------------------------------------------------------


@dataclass(frozen=True)
class CreateGang:
    """Start every replica of incarnation `attempt` together (all or none). Ranks resume from the latest complete
    checkpoint by themselves; resume_from_step is the step the core expects (None: from scratch), for logs/events.
    avoid_nodes: nodes that failed recently (placement should skip them while others fit)."""

    attempt: int
    resume_from_step: int | None = None
    avoid_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeleteGang:
    """Stop and remove every replica of `attempt` (graceful: SIGTERM, the trainer saves, then SIGKILL after a
    deadline). Idempotent: the core repeats it while replicas of that attempt are still observed."""

    attempt: int
    reason: str


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
