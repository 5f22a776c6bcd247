"""Gang semantics: all replicas of one incarnation exist together or the gang is torn down; never two gangs.

The functions that count replicas take the job as its live attempt runs it (`SeqTrainJob.with_replicas`): an elastic
gang's attempt may run fewer than spec.replicas."""

from __future__ import annotations

from dataclasses import dataclass

from seqtrain.spec import SeqTrainJob
from seqtrain.spec.elastic import sizes
from seqtrain.spec.status import ReplicaPlacement
from seqtrain_operator.controller.types import Observed, ReplicaObservation
from seqtrain_operator.planner.local import layout_of
from seqtrain_operator.planner.placement import place
from seqtrain_operator.planner.types import Plan, ReplicaAssignment, Unschedulable


@dataclass(frozen=True)
class GangView:
    """The observed replicas split by incarnation."""

    current: tuple[ReplicaObservation, ...]  # replicas of the attempt the status says is live
    stale: tuple[int, ...]  # other attempts still present (must be deleted before anything is created)

    @property
    def exists(self) -> bool:
        return bool(self.current or self.stale)


def view(observed: Observed, attempt: int) -> GangView:
    current = tuple(r for r in observed.replicas if r.attempt == attempt)
    stale = tuple(sorted({r.attempt for r in observed.replicas if r.attempt != attempt}))
    return GangView(current=current, stale=stale)


def may_create(observed: Observed) -> bool:
    """A new gang may be created only when no replica of any attempt is observed (dying ones included)."""
    return not observed.replicas


@dataclass(frozen=True)
class Admitted:
    """A gang admitted: `replicas` of them (fewer than spec.replicas only for an elastic job), placed by `plan`
    (None: the backend's scheduler places it). short: why the full gang did not fit, when it runs smaller.
    scale_up: no size fits today's nodes and the gang is created unpinned for the node autoscaler (`short` says
    what is missing)."""

    replicas: int
    plan: Plan | None = None
    short: str | None = None
    scale_up: bool = False


def autoscales(job: SeqTrainJob, observed: Observed) -> bool:
    """A native gang that does not fit is created unpinned for the node autoscaler: the job says so, or the
    operator's default does (the cluster has one) and the job does not say no."""
    own = job.spec.scheduling.autoscale
    return job.spec.scheduling.gang == "native" and (own if own is not None else observed.autoscaler)


def admit(job: SeqTrainJob, observed: Observed, avoid: tuple[str, ...]) -> Admitted | Unschedulable:
    """Gang admission, all replicas of one size or none: Unschedulable (why), or Admitted. With Observed.capacity
    the core places the gang itself (the same arithmetic as kube-scheduler's): the full size if it fits, else an
    elastic job's largest size that does (spec.minReplicas)."""
    if observed.unschedulable:
        return Unschedulable(observed.unschedulable)
    if observed.capacity is None:
        return Admitted(job.spec.replicas)
    full: Unschedulable | None = None
    for n in sizes(job):
        got = place(job.with_replicas(n), observed.capacity, avoid)
        if isinstance(got, Plan):
            return Admitted(n, got, full.reason if full else None)
        full = full or got
    assert full is not None
    if autoscales(job, observed):
        return Admitted(job.spec.replicas, None, full.reason, scale_up=True)
    return full


def growth(job: SeqTrainJob, running: int, observed: Observed, avoid: tuple[str, ...]) -> Admitted | None:
    """An elastic gang running `running` replicas: the larger size that would fit now (Observed.capacity without
    this job's own pods, which a rescale frees), or None."""
    if observed.capacity is None or running >= job.spec.replicas:
        return None
    for n in sizes(job):
        if n <= running:
            return None
        got = place(job.with_replicas(n), observed.capacity, avoid)
        if isinstance(got, Plan):
            return Admitted(n, got)
    return None


def plan_of(job: SeqTrainJob, placement: list[ReplicaPlacement]) -> Plan | None:
    """The plan recorded in status.placement (re-creating a gang whose creation was cut short must pin its pods to
    the same nodes); None when the status holds no complete plan."""
    if len(placement) != job.spec.replicas:
        return None
    return Plan(world_size=job.spec.world_size, procs_per_replica=job.spec.resources.procs, layout=layout_of(job),
                replicas=tuple(ReplicaAssignment(p.replica, p.node, tuple(p.ranks), tuple(p.domain))
                               for p in sorted(placement, key=lambda p: p.replica)))


def placement_of(plan: Plan) -> list[ReplicaPlacement]:
    return [ReplicaPlacement(replica=a.replica, node=a.node, ranks=list(a.ranks), domain=list(a.domain))
            for a in plan.replicas]


def missing(job: SeqTrainJob, current: tuple[ReplicaObservation, ...]) -> list[int]:
    """Replica indices of the live gang that are not observed at all (deleted out from under us)."""
    seen = {r.replica for r in current}
    return [i for i in range(job.spec.replicas) if i not in seen]


def gang_phase(job: SeqTrainJob, current: tuple[ReplicaObservation, ...]) -> str:
    """Summarise the live gang: Failed if any replica failed, Succeeded if all did, Running if all run or finished,
    else Pending."""
    phases = [r.phase for r in current]
    if any(p == "Failed" for p in phases):
        return "Failed"
    if len(current) >= job.spec.replicas and all(p == "Succeeded" for p in phases):
        return "Succeeded"
    if len(current) >= job.spec.replicas and all(p in ("Running", "Succeeded") for p in phases):
        return "Running"
    return "Pending"


def queued(job: SeqTrainJob, current: tuple[ReplicaObservation, ...]) -> bool:
    """The whole live gang is created and waiting in an external scheduler's queue (every replica Pending and
    queued): not stuck, so pendingGraceSeconds does not apply. A gang partly started is not queued."""
    return (len(current) >= job.spec.replicas and bool(current)
            and all(r.phase == "Pending" and r.queued for r in current))
