"""Goodput (pure): the share of wall time since the job started that produced training progress that was kept.

    goodput = running_time x kept / computed / wall_time

running_time: time the gang spent Running (all attempts; from the Running condition's transitions),
computed: steps trained including those redone after restarts (progress.step + sum(status.stepsLost)),
kept: progress.step. Scheduling waits, restart backoff and redone steps all lower it; 1.0 means every second
since the start went into steps that count.

Only `runningSeconds` (time of Running segments that already ended) is kept in the status between calls; the
current segment is measured from the Running condition's lastTransitionTime. decide() calls account() on every
decision, so every backend reports the same goodput.
"""

from __future__ import annotations

from datetime import datetime

from seqtrain.spec.status import JobStatus
from seqtrain_operator.controller.clock import parse, seconds_between
from seqtrain_operator.controller.conditions import get


def running_seconds(status: JobStatus) -> float:
    return status.running_seconds


def _running_since(status: JobStatus) -> datetime | None:
    c = get(status, "Running")
    return parse(c.last_transition_time) if c is not None and c.status == "True" else None


def account(before: JobStatus, after: JobStatus, now: datetime) -> None:
    """Update `after` (the status a decision returned) in place: close a Running segment that just ended, and
    recompute goodput."""
    total = running_seconds(before)
    since = _running_since(before)
    if since is not None and _running_since(after) is None:
        total += max(0.0, seconds_between(since, now))  # the segment ended in this decision
    after.running_seconds = round(total, 3)
    start = parse(after.start_time)
    if start is None:
        return
    wall = seconds_between(start, now)
    if wall <= 0:
        return
    current = _running_since(after)
    running = total + (max(0.0, seconds_between(current, now)) if current is not None else 0.0)
    kept = after.progress.step if after.progress else 0
    computed = kept + sum(after.steps_lost)
    useful = running * (kept / computed) if computed > 0 else 0.0
    after.goodput = round(min(1.0, useful / wall), 4)
