"""Rank 0 pushes its progress document to the operator (`POST $SEQTRAIN_PROGRESS_PUSH_URL` with `Authorization:
Bearer <token>`, the token read from the file `$SEQTRAIN_PROGRESS_PUSH_TOKEN_FILE` names; the operator sets both in
the pod manifest and mounts the file from a per-attempt Secret), for clusters where the operator cannot reach the pod
(a default-deny NetworkPolicy, an mTLS mesh): the pod only needs egress to the operator's Service.

Each push carries a sequence number (header `Seqtrain-Push-Sequence`) that grows with every push, across restarts
of the process in the same pod too (wall-clock microseconds, and at least one more than the last): the operator
ignores a document whose number is not above the last it took, so a replayed or late document never passes for a
fresh one.

Never in the way of training: one background thread sends; `poke()` (every progress update) only sets an event.
Updates are coalesced to one push per `interval` at most; with no update the last document is sent again every
`heartbeat` seconds, so the operator can tell a hung trainer (a fresh push of an old step) from a lost channel (no
push). Each push is one new connection (the Service spreads them) with a short timeout; a failure is counted and
forgotten, never raised. Proxies from the environment are ignored: the operator's Service is in the cluster.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

URL_ENV = "SEQTRAIN_PROGRESS_PUSH_URL"
TOKEN_FILE_ENV = "SEQTRAIN_PROGRESS_PUSH_TOKEN_FILE"
SEQUENCE_HEADER = "Seqtrain-Push-Sequence"
MAX_TOKEN_BYTES = 1024
MAX_BODY_BYTES = 64 * 1024  # the operator reads no more


class ProgressPusher:
    def __init__(self, url: str, token: str, document: Callable[[], bytes], interval: float = 2.0,
                 heartbeat: float = 5.0, timeout: float = 2.0) -> None:
        self.url, self._token, self._document = url, token, document
        self.interval, self.heartbeat, self.timeout = interval, heartbeat, timeout
        self.sent = 0  # pushes the operator accepted
        self.failed = 0  # pushes that failed (refused, unreachable, timed out)
        self.last_error: str | None = None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._sequence = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="seqtrain-progress-push", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, document: Callable[[], bytes], **kw: float) -> ProgressPusher | None:
        """A pusher when the pod names a push URL and a readable token file; None otherwise (the operator polls)."""
        url, path = os.environ.get(URL_ENV, "").strip(), os.environ.get(TOKEN_FILE_ENV, "").strip()
        if not url or not path:
            return None
        try:
            with open(path, "rb") as f:
                token = f.read(MAX_TOKEN_BYTES).decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return cls(url, token, document, **kw) if token else None

    def next_sequence(self) -> int:
        """Above every number this process sent, and (wall clock, microseconds) above what an earlier process of
        this pod sent, unless the clock stepped back."""
        self._sequence = max(self._sequence + 1, time.time_ns() // 1000)
        return self._sequence

    def poke(self) -> None:
        """The document changed: push it within `interval` (coalesced with other changes meanwhile)."""
        self._wake.set()

    def close(self, timeout: float | None = None) -> None:
        """Push the last document once more (the end of training), waiting at most `timeout` (default: the push
        timeout) for it, and stop."""
        self._stop.set()
        self._wake.set()
        self._thread.join(self.timeout + 0.5 if timeout is None else timeout)

    def _run(self) -> None:
        last = float("-inf")
        while not self._stop.is_set():
            self._wake.wait(self.heartbeat)
            # at most one push per interval: later changes wait for the next one (or for close)
            if self._stop.wait(max(0.0, last + self.interval - time.monotonic())):
                break
            self._wake.clear()
            last = time.monotonic()
            self._push()
        self._push()  # the final document (stop reason, last checkpoint)

    def _push(self) -> None:
        try:
            body = self._document()
            if len(body) > MAX_BODY_BYTES:
                raise ValueError(f"progress document of {len(body)} bytes (the operator takes {MAX_BODY_BYTES})")
            req = urllib.request.Request(self.url, data=body, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {self._token}",
                SEQUENCE_HEADER: str(self.next_sequence())})
            with self._opener.open(req, timeout=self.timeout) as resp:
                resp.read(1024)
            self.sent += 1
        except Exception as exc:  # noqa: BLE001 - best effort: the operator polls, or reads the termination message
            self.failed += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
