"""Rank 0's progress: a JSON object shaped like `status.progress`, served over HTTP and mirrored to a file.

The Kubernetes operator polls `GET /progress` on `runtime.progressPort` (the local backend can too), and where
its pod manifest says so rank 0 also pushes it to the operator (`seqtrain.obs.push`). The same
object is written atomically to `<workdir>/progress.json` after every update, because the HTTP server dies with
the process: the final word (e.g. `stopReason: EarlyStopped`) must outlive it. In a pod it is also written to
the container's termination-message file so the operator reads it from the pod status after exit.
"""

from __future__ import annotations

import math
import os
import threading
import time
from datetime import datetime, timezone
from typing import Any

from seqtrain.obs.httpserve import BoundedServer, serve
from seqtrain.obs.push import ProgressPusher
from seqtrain.spec.progress_doc import MAX_LOSS, dumps
from seqtrain.spec.status import Progress

PROGRESS_FILE = "progress.json"
FILE_INTERVAL_S = 1.0
# Kubernetes' default terminationMessagePath; only used when it exists (i.e. inside a container). Outside one
# (the test suite's node agent runs pods as local processes) SEQTRAIN_TERMINATION_LOG names the file instead.
TERMINATION_LOG = "/dev/termination-log"


def termination_log() -> str:
    return os.environ.get("SEQTRAIN_TERMINATION_LOG") or TERMINATION_LOG


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def write_json_atomic(path: str, obj: Any) -> None:
    """Readers never see a half-written file: write a sibling, then rename over the target."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps(obj))  # strict JSON: a non-finite figure is written as null
    os.replace(tmp, path)


def _holds_progress_or_nothing(path: str) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(64).lstrip()
    return not head or head.startswith("{")


class ProgressReporter:
    """Holds the latest `Progress`; serves it on HTTP (if a port is given) and mirrors it to a file."""

    def __init__(self, workdir: str, total_steps: int, port: int | None = None, addr: str = "0.0.0.0") -> None:
        self.path = os.path.join(workdir, PROGRESS_FILE)
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()
        self._progress = Progress(step=0, total_steps=total_steps)
        self._written = -FILE_INTERVAL_S
        self._non_finite = 0  # steps whose loss was not finite (progress.nonFiniteSteps)
        self._non_finite_step: int | None = None
        self._server: BoundedServer | None = None
        if port is not None:
            self._server = self._start(port, addr)
        # pushed to the operator too where its pod manifest says so (seqtrain.obs.push)
        self.pusher = ProgressPusher.from_env(self.document)

    def document(self) -> bytes:
        """The progress as served, pushed and written: JSON of `status.progress`'s shape."""
        return dumps(self.progress.model_dump(by_alias=True, mode="json", exclude_none=True)).encode()

    @property
    def port(self) -> int | None:
        """The bound port (useful with port 0: any free port), None when not serving."""
        return int(self._server.server_address[1]) if self._server is not None else None

    @property
    def progress(self) -> Progress:
        with self._lock:
            return self._progress.model_copy()

    def update(self, flush: bool = False, **fields: Any) -> None:
        """Set fields of the progress (snake_case names of `Progress`) and stamp updatedAt. The file copy is
        rewritten at most every `FILE_INTERVAL_S` (a write costs milliseconds on some filesystems, more than
        the rest of the observability per step), and always with `flush=True` (evaluations, the end)."""
        with self._lock:
            if "loss" in fields:
                fields |= self._loss_fields(fields["loss"], fields.get("step", self._progress.step))
            # any other figure that is not finite (an MFU from a zero step time) is unknown, never NaN
            fields = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in fields.items()}
            if "step" in fields and self._progress.total_steps > 0:
                fields["percent"] = round(min(100.0, 100.0 * fields["step"] / self._progress.total_steps), 1)
            self._progress = self._progress.model_copy(update={**fields, "updated_at": now_iso()})
            due = flush or time.monotonic() - self._written >= FILE_INTERVAL_S
            if due:
                self._written = time.monotonic()
        if due:
            # Two threads update (the training loop and the checkpoint watcher, seqtrain.obs.callbacks): one writes
            # at a time, each the latest progress, so the file never ends older than the last update.
            with self._file_lock:
                write_json_atomic(self.path, self.progress.model_dump(by_alias=True, mode="json", exclude_none=True))
        if self.pusher is not None:
            self.pusher.poke()  # sent by its thread, at most every few seconds

    def _loss_fields(self, loss: Any, step: int) -> dict[str, Any]:
        """A loss that is not a finite number (NaN, Infinity, beyond MAX_LOSS: the step diverged) is reported as
        null with lossNonFinite, and counted once per step in nonFiniteSteps: JSON has no NaN, and the operator's
        status write would be refused with one."""
        if not isinstance(loss, int | float) or (math.isfinite(loss) and abs(loss) <= MAX_LOSS):
            return {"loss": loss, "loss_non_finite": None}
        if self._non_finite_step != step:
            self._non_finite, self._non_finite_step = self._non_finite + 1, step
        return {"loss": None, "loss_non_finite": True, "non_finite_steps": self._non_finite}

    def finish(self) -> None:
        """Leave the final progress where the operator can read it after the process is gone."""
        self.update(flush=True)
        path = termination_log()
        if os.path.exists(path) and os.access(path, os.W_OK):
            try:
                if not _holds_progress_or_nothing(path):
                    return  # another rank of this pod failed and left its error line: that is the pod's message
                with open(path, "w", encoding="utf-8") as f:
                    f.write(self.document().decode())
            except OSError:
                pass  # best effort: progress.json in the workdir still has it

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()  # one last push of the final document, bounded by the push timeout
            self.pusher = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _start(self, port: int, addr: str) -> BoundedServer | None:
        def progress() -> tuple[int, str, bytes]:
            return 200, "application/json", self.document()

        def healthz() -> tuple[int, str, bytes]:
            return 200, "application/json", b'{"ok": true}'

        # bounded: connections, time, request size (seqtrain.obs.httpserve)
        return serve(port, addr, {"/progress": progress, "/": progress, "/healthz": healthz}, "progress")
