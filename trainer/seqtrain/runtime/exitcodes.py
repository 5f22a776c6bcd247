"""Exit codes of `seqtrain train`: the controller classifies a rank's end by them."""

from __future__ import annotations

OK = 0
ERROR = 1  # anything unexpected: retryable (restart the gang from the latest checkpoint)
INVALID_CONFIG = 3  # the config cannot work; restarting will not help (permanent)
COMM_TIMEOUT = 4  # a collective failed because a peer hung (timeout) or died (connection closed): retryable
DEVICE_UNAVAILABLE = 5  # a GPU job sees no CUDA device: the node is broken (infrastructure; avoid the node)
CHECKPOINT_UNAVAILABLE = 6  # a checkpoint could not be loaded now (OOM, CUDA, storage I/O): infrastructure, kept
STORAGE_FULL = 7  # a write found the volume full (ENOSPC, EDQUOT): infrastructure, the node is not avoided
TERMINATED = 143  # SIGTERM received; the current step finished and a checkpoint was saved (128 + 15)

RETRYABLE = frozenset({ERROR, COMM_TIMEOUT, DEVICE_UNAVAILABLE, CHECKPOINT_UNAVAILABLE, STORAGE_FULL, TERMINATED})
PERMANENT = frozenset({INVALID_CONFIG})


def storage_full(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is a write refused for want of space: a full volume is
    the storage's fault, not the training's, so it must not spend faultTolerance.maxRestarts (a checkpoint volume
    full for half a minute failed a job twice in the chaos soak, once per restart that met it)."""
    import errno

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class InvalidConfig(Exception):
    """The trainer config is unusable; the message names the field and the fix. Exits INVALID_CONFIG."""


class DeviceUnavailable(Exception):
    """The job asks for GPUs but this process sees none: the node (driver, device plugin), not the config, is at
    fault. Exits DEVICE_UNAVAILABLE: the operator restarts the gang elsewhere."""
# The last line a failing rank prints: "seqtrain train: error: <ExceptionType>: <first line of its message>". The
# backends read it back (the local runner from the rank's log, Kubernetes from the termination message, which falls
# back to the log tail) so the controller can tell a failure that repeats identically from one that varies.
ERROR_MARKER = "seqtrain train: error: "
_ERROR_MAX = 240


# What rank 0 is doing before its first step (rendezvous, model, engine, data, checkpoint, first step), one line per
# phase in its log: "seqtrain phase: <what>". The local runner shows it on the progress bar with its elapsed time.
PHASE_MARKER = "seqtrain phase: "


def announce_phase(what: str) -> None:
    print(f"{PHASE_MARKER}{what}", flush=True)


def phase_of(line: str) -> str | None:
    """The phase a log line announces, or None."""
    at = line.find(PHASE_MARKER)
    return line[at + len(PHASE_MARKER):].strip() or None if at >= 0 else None


def error_line(exc: BaseException) -> str:
    """One line naming the exception: its type and the first line of its message, shortened."""
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text[:_ERROR_MAX]


def last_error(text: str | None) -> str | None:
    """The error a rank reported in the tail of its log / termination message (None when it reported none)."""
    if not text:
        return None
    found = None
    for line in text.splitlines():
        at = line.find(ERROR_MARKER)
        if at >= 0:
            found = line[at + len(ERROR_MARKER):].strip()[:_ERROR_MAX]
    return found or None
