"""Publishing a step folder (rank 0): meta.json with every file's size and sha256, the atomic rename, pruning.

Its own module because two processes publish: the training rank (synchronous saves, the writer thread) and the
writer process (`seqtrain.checkpoint.writer`), which imports this and not the manager (the manager imports the
writer).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from seqtrain.checkpoint.discovery import (
    DELETE_PREFIX,
    META_FILE,
    TMP_PREFIX,
    file_hashes,
    file_sizes,
    list_checkpoints,
    remove_tree,
    step_dir,
)
from seqtrain.spec.status import json_safe


@dataclass(frozen=True)
class Publisher:
    """What rank 0 needs to publish a step folder (picklable: the writer process publishes too)."""

    directory: str
    keep: int
    world: int
    protected: frozenset[int] = frozenset()


def publish(p: Publisher, step: int, tmp: str, meta: dict[str, Any] | None) -> None:
    """Rank 0: meta.json (sizes and sha256 of every file), then the atomic rename and pruning."""
    final = step_dir(p.directory, step)
    files = sorted(os.listdir(tmp))
    record = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "world": p.world, "files": files, **(meta or {}),
              "sizes": file_sizes(tmp),  # checked before every resume: a truncated file is caught
              "sha256": file_hashes(tmp)}  # checked by rank 0 before a resume loads it: a bit flip
    with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
        json.dump(json_safe(record), f, indent=2, allow_nan=False)  # a diverged step's NaN loss as null
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    if os.path.exists(final):  # a step redone after a restart: the new copy replaces the old one
        remove(p.directory, final)
    os.rename(tmp, final)
    fsync_path(p.directory)
    prune(p)


def remove(directory: str, path: str) -> None:
    # Rename first so a crash mid-delete never leaves a half-deleted step-N that still has its meta.json.
    doomed = os.path.join(directory, DELETE_PREFIX + os.path.basename(path)[len("step-"):])
    remove_tree(doomed)
    os.rename(path, doomed)
    remove_tree(doomed)


def prune(p: Publisher) -> None:
    """Keep the latest `keep` complete checkpoints; remove older ones and leftovers of interrupted saves."""
    complete = list_checkpoints(p.directory)
    for c in complete[: max(0, len(complete) - p.keep)]:
        if c.step not in p.protected:
            remove(p.directory, c.path)
    newest = complete[-1].step if complete else -1
    for name in os.listdir(p.directory):
        if name.startswith(DELETE_PREFIX):
            remove_tree(os.path.join(p.directory, name))
        elif name.startswith(TMP_PREFIX):
            tail = name[len(TMP_PREFIX):]
            if tail.isdigit() and int(tail) <= newest:
                remove_tree(os.path.join(p.directory, name))


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
