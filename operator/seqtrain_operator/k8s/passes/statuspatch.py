"""What a pass writes of the status it decided (pure): whether it is worth a write, and the merge patch."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from seqtrain.spec import JobStatus, SeqTrainJob
from seqtrain_operator.controller import conditions as cond

# Figures that move on every pass while a gang runs (goodput and the lost-time accounting behind it).
_DRIFT = ("goodput", "productiveSeconds", "lostSeconds", "timeLedger")


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) turning `old` into `new`: vanished keys are nulled at every depth."""
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict):
            patch[k] = status_patch(old[k], v)
        else:
            patch[k] = v
    return patch


def changed(old: dict[str, Any], new: dict[str, Any], coalesce_progress: bool = False) -> bool:
    """Whether the status is worth a write: goodput alone drifts every pass while a gang runs; it rides along with
    the next real change (progress, a condition, a phase) instead of costing one API write per job per pass.
    `coalesce_progress`: progress too (a step count moving on) waits for the next write (Settings.progress_interval)."""
    drift = _DRIFT + ("progress",) if coalesce_progress else _DRIFT
    return {k: v for k, v in new.items() if k not in drift} != {k: v for k, v in old.items() if k not in drift}


def storage_condition(job: SeqTrainJob, st: JobStatus, now: datetime) -> None:
    """CheckpointsPersistent: whether a restarted gang finds its checkpoints."""
    ck = job.spec.checkpoint
    if ck.pvc or (ck.path and "://" in ck.path):
        cond.set_condition(st, "CheckpointsPersistent", "True", "Configured",
                           f"checkpoints on {'PVC ' + ck.pvc if ck.pvc else ck.path}", now)
    else:
        cond.set_condition(st, "CheckpointsPersistent", "False", "EmptyDir",
                           "no checkpoint.pvc: checkpoints live in the pods' emptyDir and a restarted gang starts "
                           "from scratch; set spec.checkpoint.pvc to a ReadWriteMany claim", now)
