"""The run folder as the local backend reads and writes it: status.json, metrics.jsonl, checkpoints/step-N."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from seqtrain.checkpoint import discovery
from seqtrain.spec.status import CheckpointPolicy, CheckpointRef, JobStatus, Progress, WorkAtRisk
from seqtrain_operator.controller.checkpoint_policy import checkpoint_report
from seqtrain_operator.controller.clock import iso


def atomic_write_text(path: str, text: str) -> None:
    """Write via a temporary file in the same folder + rename, so a reader never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_status(workdir: str, status: JobStatus) -> None:
    atomic_write_text(os.path.join(workdir, "status.json"), json.dumps(status.to_dict(), indent=2) + "\n")


def read_status(workdir: str) -> JobStatus | None:
    """The persisted status, or None when absent. A corrupt file is treated as absent (it is rewritten atomically,
    so this only happens when someone edited it by hand)."""
    try:
        with open(os.path.join(workdir, "status.json"), encoding="utf-8") as f:
            return JobStatus.model_validate(json.load(f))
    except (OSError, ValueError, ValidationError):
        return None


def latest_checkpoint(checkpoint_dir: str) -> CheckpointRef | None:
    """The highest COMPLETE checkpoint, by the trainer's own rule (seqtrain.checkpoint.discovery, torch-free): a
    `step-N` folder whose meta.json names step N and lists only files that exist. `.tmp-*` folders never count."""
    info = discovery.latest_checkpoint(checkpoint_dir)
    if info is None:
        return None
    when = info.time
    if when is None:
        mtime = os.path.getmtime(os.path.join(info.path, discovery.META_FILE))
        when = iso(datetime.fromtimestamp(mtime, timezone.utc))
    return CheckpointRef(step=info.step, path=info.path, time=when)


class MetricsTail:
    """Follows metrics.jsonl as rank 0 appends to it. The trainer rewrites the file on resume (dropping steps past the
    checkpoint), so a shrunken or replaced file is read again from the start."""

    def __init__(self, path: str):
        self.path = path
        self._offset = 0
        self._ino: int | None = None
        self._partial = ""
        self.last: dict[str, Any] | None = None

    def poll(self) -> dict[str, Any] | None:
        """Read what was appended since the last call; return the latest complete record (or the previous one)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return self.last
        if st.st_ino != self._ino or st.st_size < self._offset:
            self._ino, self._offset, self._partial = st.st_ino, 0, ""
        if st.st_size == self._offset:
            return self.last
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()  # an unterminated line is completed by a later write
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "step" in rec:
                self.last = rec
        return self.last

    def progress(self) -> Progress | None:
        rec = self.poll()
        if rec is None:
            return None
        t = rec.get("time")
        updated = iso(datetime.fromtimestamp(float(t), timezone.utc)) if isinstance(t, int | float) else None
        tps = rec.get("tokens_per_s")
        return Progress(step=int(rec["step"]), loss=_num(rec.get("loss")),
                        tokens_per_second=_num(tps), updated_at=updated)


# What the trainer's progress.json (seqtrain.obs.progress) adds to the metrics.jsonl view of progress.
_TRAINER_PROGRESS_FIELDS = ("mfu", "val_loss", "val_perplexity", "val_bits_per_byte", "best_val_loss", "best_step",
                            "stop_reason", "stop_message", "attempt", "training_started_at", "checkpoint_seconds",
                            "step_seconds", "restart_round", "step_reached_before", "resumed_from")


def with_trainer_progress(progress: Progress | None, path: str) -> Progress | None:
    """Overlay MFU, validation figures and the stop reason from `<workdir>/progress.json` (rank 0 writes it
    atomically) onto the progress read from metrics.jsonl."""
    if progress is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            extra = Progress.model_validate(json.load(f))
    except (OSError, ValueError):
        return progress
    out = progress.model_copy()
    for name in _TRAINER_PROGRESS_FIELDS:
        setattr(out, name, getattr(extra, name))
    return out


def trainer_checkpoint_report(path: str) -> tuple[CheckpointPolicy | None, WorkAtRisk | None]:
    """`checkpointPolicy` and `workAtRisk` from `<workdir>/progress.json` (None when absent or unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            return checkpoint_report(json.load(f))
    except (OSError, ValueError):
        return None, None


def read_metrics(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "step" in rec:
                    out.append(rec)
    except OSError:
        pass
    return out


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) else None
