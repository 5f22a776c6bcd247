"""Kubernetes-style conditions on JobStatus: lastTransitionTime changes only when the status value changes."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from seqtrain.spec.status import Condition, JobStatus
from seqtrain_operator.controller.clock import iso

# One condition per phase that has a condition of its own; entering a phase sets its condition True and the
# others False, so `kubectl wait --for=condition=Succeeded` works.
PHASE_CONDITIONS = ("Running", "Restarting", "Succeeded", "Failed", "Suspended")


def get(status: JobStatus, type_: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == type_), None)


def set_condition(status: JobStatus, type_: str, value: Literal["True", "False", "Unknown"], reason: str,
                  message: str, now: datetime) -> None:
    cur = get(status, type_)
    if cur is None:
        status.conditions.append(Condition(type=type_, status=value, reason=reason, message=message,
                                           last_transition_time=iso(now)))
        return
    if cur.status != value:
        cur.last_transition_time = iso(now)
    cur.status = value
    cur.reason = reason
    cur.message = message


def enter_phase(status: JobStatus, phase: str, reason: str, message: str, now: datetime) -> None:
    """Set the phase and message, flip the phase conditions accordingly."""
    status.phase = phase  # type: ignore[assignment]
    status.message = message
    for t in PHASE_CONDITIONS:
        if t == phase:
            set_condition(status, t, "True", reason, message, now)
        elif (c := get(status, t)) is not None and c.status == "True":
            set_condition(status, t, "False", reason, message, now)
