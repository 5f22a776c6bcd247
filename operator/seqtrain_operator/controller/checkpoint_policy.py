"""The controller's share of `checkpoint.intervalSteps: auto` and of checkpoint-aware preemption (pure).

Out to the trainer: the job's failure history (`FailureHistory` in the trainer config of every attempt), from which
rank 0 estimates the gang's MTBF (seqtrain.train.interval). Back from the trainer: its progress document's
`checkpointPolicy` (the interval in force and where its inputs came from) and `workAtRisk` (what a failure now would
lose), which land in `status.checkpointPolicy` and `status.workAtRisk`, the checkpoint's age refreshed at every
decision (it keeps growing while no trainer reports, e.g. during a restart). Out to a queue: `priority_boost`, the
work at risk as Kueue's priority boost, so its preemption prefers the victims that lose the least.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from seqtrain.spec.progress_doc import read_checkpoint_report
from seqtrain.spec.runtime import FailureHistory
from seqtrain.spec.status import CheckpointPolicy, JobStatus, WorkAtRisk
from seqtrain_operator.controller.clock import parse, seconds_between


def failure_history(status: JobStatus, rank_mtbf_hours: float | None = None) -> FailureHistory:
    """What an attempt about to start is told: every gang restart so far (training and infrastructure failures
    alike: both lose the work since the last checkpoint) over the time the gang ran."""
    return FailureHistory(failures=status.restarts + status.infra_restarts, running_seconds=status.running_seconds,
                          rank_mtbf_hours=rank_mtbf_hours)


def checkpoint_report(data: Any) -> tuple[CheckpointPolicy | None, WorkAtRisk | None]:
    """`checkpointPolicy` and `workAtRisk` of a progress document, read by the one progress reader; None for what is
    absent or malformed (the pod is the user's: a bad document loses these figures, never the reconcile)."""
    return read_checkpoint_report(data)


def record(st: JobStatus, policy: CheckpointPolicy | None, at_risk: WorkAtRisk | None, now: datetime) -> None:
    """Copy what the trainer reported into `st` (in place) and age its latest checkpoint to `now`."""
    if policy is not None:
        st.checkpoint_policy = policy.model_copy()
    if at_risk is not None:
        st.work_at_risk = at_risk.model_copy()
    risk, ck = st.work_at_risk, st.last_checkpoint
    if risk is None or ck is None or ck.step != risk.checkpoint_step:
        return
    saved = parse(ck.time)
    if saved is not None:
        risk.checkpoint_age_seconds = round(max(0.0, seconds_between(saved, now)), 3)


def priority_boost(at_risk: WorkAtRisk | None, seconds_per_point: float, max_boost: int) -> int:
    """Kueue's `kueue.x-k8s.io/priority-boost` for a running job (KEP-7990; Kueue v0.17+ with its PriorityBoost
    feature gate): one point per `seconds_per_point` of training a preemption now would lose, at most `max_boost`.

    Kueue orders preemption candidates by priority + boost (lowest first), so among jobs of one priority it takes the
    one that loses the least. Whole points only: the boost changes once per `seconds_per_point` of training and
    drops to 0 at each checkpoint, not at every step (the KEP leaves flapping to the controller). Never negative:
    a running job never falls below a pending one of its class, which would let that one preempt it. Keep
    `max_boost` below the gap between your priority classes so the boost orders victims within a class and never
    lifts a job into the next one. 0 when off (`seconds_per_point` <= 0) or nothing is reported."""
    if seconds_per_point <= 0 or max_boost <= 0 or at_risk is None:
        return 0
    return max(0, min(max_boost, int(at_risk.seconds // seconds_per_point)))
