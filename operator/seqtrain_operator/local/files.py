"""The run folder as the local backend reads and writes it: status.json, metrics.jsonl, checkpoints/step-N."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from seqtrain.checkpoint import discovery
from seqtrain.spec.progress_doc import (
    MAX_DOC_BYTES,
    ProgressError,
    Reported,
    read_metrics_record,
    reported_or_nothing,
    with_latest_step,
)
from seqtrain.spec.status import CheckpointPolicy, CheckpointRef, JobStatus, Progress, WorkAtRisk
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
    text = json.dumps(status.to_dict(), indent=2, allow_nan=False)  # to_dict writes a non-finite figure as null
    atomic_write_text(os.path.join(workdir, "status.json"), text + "\n")


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
        # tokens and training seconds of every step in the file: the run's average where a record lacks the
        # trainer's own (run_tokens_per_s); the file holds the kept steps of earlier attempts too
        self.tokens = 0.0
        self.seconds = 0.0

    def poll(self) -> dict[str, Any] | None:
        """Read what was appended since the last call; return the latest complete record (or the previous one)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return self.last
        if st.st_ino != self._ino or st.st_size < self._offset:
            self._ino, self._offset, self._partial = st.st_ino, 0, ""
            self.tokens = self.seconds = 0.0
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
                tokens, seconds = rec.get("tokens"), rec.get("step_time_s")
                if _figure(tokens) and _figure(seconds):
                    self.tokens += tokens
                    self.seconds += seconds
        return self.last

    def progress(self) -> Progress | None:
        """The latest step as the progress document's reader sees it (None before the first step, or when the
        record is not one a trainer writes)."""
        rec = self.poll()
        if rec is None:
            return None
        return progress_of_record(rec, self.tokens / self.seconds if self.seconds > 0 else None)


def _figure(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e15


def progress_of_record(rec: dict[str, Any], run_tokens_per_s: float | None = None) -> Progress | None:
    """A metrics.jsonl record -> Progress, through the one progress reader (None for a record it refuses)."""
    try:
        return read_metrics_record(rec, run_tokens_per_s)
    except ProgressError:
        return None


def read_trainer_progress(path: str) -> Reported:
    """`<workdir>/progress.json` through the one progress reader; `Reported()` when absent or refused."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_DOC_BYTES + 1)
    except OSError:
        return Reported()
    return reported_or_nothing(raw)


def with_trainer_progress(progress: Progress | None, path: str) -> Progress | None:
    """The progress read from metrics.jsonl (the latest step), with what the trainer's `<workdir>/progress.json`
    adds: MFU, validation figures, the stop reason, the attempt, the run's average tokens/s and ETA where the
    record lacks them (seqtrain.spec.progress_doc.with_latest_step)."""
    if progress is None:
        return None
    return with_latest_step(read_trainer_progress(path).progress, progress)


def trainer_checkpoint_report(path: str) -> tuple[CheckpointPolicy | None, WorkAtRisk | None]:
    """`checkpointPolicy` and `workAtRisk` from `<workdir>/progress.json` (None when absent or unreadable)."""
    reported = read_trainer_progress(path)
    return reported.policy, reported.at_risk


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
