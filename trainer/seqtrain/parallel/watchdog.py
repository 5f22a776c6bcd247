"""A hung collective must not hang silently.

The loop labels what each rank is about to wait for (`waiting("step 12: gradient all-reduce over dp")`).
Two things end a hang, whichever comes first:
  * the process group's own timeout (`optimization.commTimeoutSeconds`, gloo raises; NCCL with async error
    handling aborts): `seqtrain.train.entry` maps it to exit code 4 and names the label from `current()`;
  * this watchdog thread, a little later, for hangs that never raise (a peer stuck in compute, an NCCL
    kernel that never completes): it logs the rank, the label and the time waited, and exits with code 4.
The controller treats exit code 4 as retryable and restarts the whole gang from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

from seqtrain.runtime.exitcodes import COMM_TIMEOUT

_lock = threading.Lock()
_active: dict[str, float] = {}  # label -> monotonic start (the main thread's current wait)
_watchdog: Watchdog | None = None


_failed: list[str] = []  # the label of the last wait that ended with an exception


def current() -> str | None:
    """What this rank is waiting for right now, or the wait an exception just came out of (None otherwise)."""
    with _lock:
        return next(iter(_active), None) or (_failed[-1] if _failed else None)


_deadline: dict[str, float] = {}  # label -> its own deadline in seconds (checkpoint I/O), else the watchdog's


@contextlib.contextmanager
def waiting(label: str, deadline_s: float | None = None) -> Iterator[None]:
    """Label what this rank waits for; `deadline_s` replaces the watchdog's collective deadline for this wait (a
    checkpoint save waits on storage, not on peers)."""
    with _lock:
        _active.clear()
        _failed.clear()
        _deadline.clear()
        _active[label] = time.monotonic()
        if deadline_s is not None:
            _deadline[label] = deadline_s
    try:
        yield
    except BaseException:
        with _lock:
            _failed.append(label)  # entry.py reports it when this turns out to be a communication timeout
        raise
    finally:
        with _lock:
            _active.pop(label, None)


class Watchdog(threading.Thread):
    def __init__(self, timeout_s: float, rank: int, grace_s: float | None = None) -> None:
        super().__init__(name="seqtrain-collective-watchdog", daemon=True)
        # the process group's timeout should fire first; the watchdog catches what it cannot
        self.deadline_s = timeout_s + (grace_s if grace_s is not None else max(5.0, 0.1 * timeout_s))
        self.rank = rank
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(min(1.0, self.deadline_s / 4)):
            with _lock:
                item = next(iter(_active.items()), None)
                limit = _deadline.get(item[0], self.deadline_s) if item else self.deadline_s
            if item and time.monotonic() - item[1] > limit:
                print(f"seqtrain: rank {self.rank}: collective timeout: waited {time.monotonic() - item[1]:.0f}s "
                      f"for {item[0]}; exiting with code {COMM_TIMEOUT} so the gang restarts",
                      file=sys.stderr, flush=True)
                os._exit(COMM_TIMEOUT)


def start(timeout_s: float, rank: int, grace_s: float | None = None) -> Watchdog:
    """Start the (one) watchdog of this process."""
    global _watchdog
    if _watchdog is None or not _watchdog.is_alive():
        _watchdog = Watchdog(timeout_s, rank, grace_s)
        _watchdog.start()
    return _watchdog
