"""A diagnostic: where the operator's memory goes, by allocation site (`SEQTRAIN_OPERATOR_TRACEMALLOC=FILE`).

tracemalloc traces every allocation from the start; SIGUSR2 (and the operator's exit) writes the top sites by size
to FILE, with current and peak traced memory. It slows the operator (every allocation is traced): for finding what
to trim, never for the benchmark's figures.
"""

from __future__ import annotations

import os
import signal
import tracemalloc

ENV = "SEQTRAIN_OPERATOR_TRACEMALLOC"


FRAMES_ENV = "SEQTRAIN_OPERATOR_TRACEMALLOC_FRAMES"  # > 1: also the top call paths (who keeps it)


def dump(path: str, top: int = 60) -> None:
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    current, peak = tracemalloc.get_traced_memory()
    lines = [f"traced now {current / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB"]
    for stat in snap.statistics("lineno")[:top]:
        lines.append(f"{stat.size / 2**20:8.2f} MiB {stat.count:9d} blocks  {stat.traceback[0]}")
    if tracemalloc.get_traceback_limit() > 1:
        for stat in snap.statistics("traceback")[:top // 3]:
            lines.append(f"--- {stat.size / 2**20:.2f} MiB {stat.count} blocks")
            lines.extend(f"    {frame}" for frame in stat.traceback.format()[::-2])
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def install() -> str | None:
    """Start tracing when the variable names a file; returns it (None: not asked for)."""
    path = os.environ.get(ENV, "").strip()
    if not path:
        return None
    tracemalloc.start(max(1, int(os.environ.get(FRAMES_ENV, "1") or 1)))
    signal.signal(signal.SIGUSR2, lambda *_: dump(path))
    return path
