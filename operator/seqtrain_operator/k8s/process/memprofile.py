"""A diagnostic: where the operator's memory goes, by allocation site (`SEQTRAIN_OPERATOR_TRACEMALLOC=FILE`).

tracemalloc traces every allocation from the start; SIGUSR2 (and the operator's exit) writes the top sites by size
to FILE, with current and peak traced memory. It slows the operator (every allocation is traced): for finding what
to trim, never for the benchmark's figures. With `SEQTRAIN_OPERATOR_TRACEMALLOC_PEAK=1` a thread also writes
FILE.peak whenever traced memory passes its last such dump by 10 %: what was held at the peak, which VmHWM (the
benchmark's figure) remembers, not what is left at the end. `SEQTRAIN_OPERATOR_CENSUS=FILE` instead: SIGUSR2 writes
a census of the live heap (objects by type, the Kubernetes bodies held and who holds the jobs'), untraced and at full
speed until asked.
"""

from __future__ import annotations

import collections
import gc
import os
import signal
import threading
import time
import tracemalloc

ENV = "SEQTRAIN_OPERATOR_TRACEMALLOC"


FRAMES_ENV = "SEQTRAIN_OPERATOR_TRACEMALLOC_FRAMES"  # > 1: also the top call paths (who keeps it)
PEAK_ENV = "SEQTRAIN_OPERATOR_TRACEMALLOC_PEAK"
CENSUS_ENV = "SEQTRAIN_OPERATOR_CENSUS"  # FILE: SIGUSR2 writes a census of the heap there (no tracemalloc needed)


def census(path: str) -> None:
    """Objects by type, the Kubernetes objects held (by kind, with and without managedFields) and what holds the
    jobs' bodies: who keeps memory, where tracemalloc's sites only say who allocated it."""
    objs = gc.get_objects()
    bodies: dict[str, list[dict]] = collections.defaultdict(list)
    for o in objs:
        if type(o) is dict and isinstance(o.get("metadata"), dict) and ("spec" in o or "status" in o):
            bodies[str(o.get("kind") or "(no kind: a projection)")].append(o)
    lines = [f"{len(objs)} objects tracked by gc"]
    for kind, items in sorted(bodies.items(), key=lambda kv: -len(kv[1])):
        with_mf = sum(1 for b in items if "managedFields" in b["metadata"])
        lines.append(f"{len(items):7d} {kind} bodies ({with_mf} with managedFields)")
    holders: collections.Counter[str] = collections.Counter()
    skip = {id(objs), id(bodies)} | {id(v) for v in bodies.values()}
    for body in bodies.get("SeqTrainJob", [])[:200]:  # get_referrers scans the whole heap each time
        for r in gc.get_referrers(body):
            if id(r) in skip:
                continue
            what = type(r).__name__
            if isinstance(r, dict):
                what += " {" + ", ".join(map(str, list(r)[:4])) + "}"
            elif hasattr(r, "f_code"):
                what += f" {r.f_code.co_filename.rsplit('/', 1)[-1]}:{r.f_code.co_name}"
            holders[what] += 1
    lines.append("what holds the SeqTrainJob bodies (of the first 200):")
    lines.extend(f"{n:7d} {what}" for what, n in holders.most_common(25))
    lines.append("objects by type:")
    lines.extend(f"{n:9d} {t}" for t, n in collections.Counter(type(o).__name__ for o in objs).most_common(30))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


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
    if where := os.environ.get(CENSUS_ENV, "").strip():
        signal.signal(signal.SIGUSR2, lambda *_: census(where))
        return None
    path = os.environ.get(ENV, "").strip()
    if not path:
        return None
    tracemalloc.start(max(1, int(os.environ.get(FRAMES_ENV, "1") or 1)))
    signal.signal(signal.SIGUSR2, lambda *_: dump(path))
    if os.environ.get(PEAK_ENV, "") == "1":
        threading.Thread(target=_follow_peak, args=(path + ".peak",), name="tracemalloc-peak", daemon=True).start()
    return path


def _follow_peak(path: str, every: float = 1.0) -> None:
    dumped = 0
    while True:
        time.sleep(every)
        current, _ = tracemalloc.get_traced_memory()
        if current > dumped * 1.1:
            dump(path)
            dumped = current
