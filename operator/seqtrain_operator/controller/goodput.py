"""Goodput (pure): the share of the job's wall time that trained steps that were kept.

    goodput = productiveSeconds / (productiveSeconds + sum(lostSeconds))

The denominator is the wall time from the job's creation (to its completion); controller/lost_time.py splits it
into productive training and lost time by reason (queueing, start-up, checkpoint stall, restart, recomputed steps,
suspended), so goodput and the lost figures add up by construction. 1.0 means every second since the job was
created went into steps that count. decide() calls lost_time.account() and then account() on every decision, so
every backend reports the same goodput.

`runningSeconds` (time of Running segments that already ended; the current one runs from the Running condition's
lastTransitionTime) is still kept in the status for readers of it.
"""

from __future__ import annotations

from datetime import datetime

from seqtrain.spec.status import JobStatus
from seqtrain_operator.controller.clock import parse, seconds_between
from seqtrain_operator.controller.conditions import get
from seqtrain_operator.controller.lost_time import wall_seconds


def running_seconds(status: JobStatus) -> float:
    return status.running_seconds


def _running_since(status: JobStatus) -> datetime | None:
    c = get(status, "Running")
    return parse(c.last_transition_time) if c is not None and c.status == "True" else None


def account(before: JobStatus, after: JobStatus, now: datetime) -> None:
    """Update `after` (the status a decision returned, lost time already accounted) in place: close a Running
    segment that just ended, and recompute goodput."""
    total = running_seconds(before)
    since = _running_since(before)
    if since is not None and _running_since(after) is None:
        total += max(0.0, seconds_between(since, now))  # the segment ended in this decision
    after.running_seconds = round(total, 3)
    wall = wall_seconds(after)
    if after.productive_seconds is not None and wall > 0:
        after.goodput = round(min(1.0, after.productive_seconds / wall), 4)
