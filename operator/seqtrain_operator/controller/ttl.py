"""`spec.ttlSecondsAfterFinished`: when a finished job is deleted. Pure (the time comes in as an argument)."""

from __future__ import annotations

from datetime import datetime, timedelta

from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import TERMINAL_PHASES, JobStatus
from seqtrain_operator.controller.clock import parse, seconds_between
from seqtrain_operator.controller.types import Action, DeleteJob, Event, RequeueAfter


def expire(job: SeqTrainJob, status: JobStatus, now: datetime) -> list[Action]:
    """[DeleteJob] once the TTL after status.completionTime has passed, [RequeueAfter(rest)] before, [] without a
    TTL or for a job that is not finished. Counted from completionTime (persisted), so an operator restart neither
    resets nor skips the wait."""
    ttl = job.spec.ttl_seconds_after_finished
    if ttl is None or status.phase not in TERMINAL_PHASES:
        return []
    done = parse(status.completion_time)
    if done is None:  # finished without a completionTime (an older operator): the last condition change
        times = [t for c in status.conditions if (t := parse(c.last_transition_time)) is not None]
        if not times:
            why = f"ttlSecondsAfterFinished ({ttl}s): finished at an unknown time"
            return [Event("Normal", "TTLExpired", f"{why}: deleting it"), DeleteJob(why)]
        done = max(times)
    due = done + timedelta(seconds=ttl)
    if now >= due:
        why = f"ttlSecondsAfterFinished ({ttl}s) passed since the job {status.phase.lower()}"
        return [Event("Normal", "TTLExpired", f"{why}: deleting it"), DeleteJob(why)]
    return [RequeueAfter(max(0.05, seconds_between(now, due)))]
