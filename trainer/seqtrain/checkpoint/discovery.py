"""Finding complete checkpoints. Torch-free: the controller uses it to report and pick the resume step.

A checkpoint is complete when `<dir>/step-<N>/meta.json` parses, names step N, and every file it lists exists.
`.tmp-*` folders (a save in progress or cut by a crash) and folders without meta.json are never used.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
DELETE_PREFIX = ".del-step-"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def time(self) -> str | None:
        return self.meta.get("time")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"{STEP_PREFIX}{step}")


def read_complete(path: str) -> CheckpointInfo | None:
    """The checkpoint at `path` if it is complete, else None."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if not m:
        return None
    try:
        with open(os.path.join(path, META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("step") != int(m.group(1)):
        return None
    files = meta.get("files", [])
    # entries may be folders: sharded engines (DeepSpeed zero/, FSDP2 DCP fsdp/) write one per checkpoint
    if not isinstance(files, list) or not all(os.path.exists(os.path.join(path, str(name))) for name in files):
        return None
    return CheckpointInfo(step=int(m.group(1)), path=path, meta=meta)


def list_checkpoints(directory: str) -> list[CheckpointInfo]:
    """Complete checkpoints under `directory`, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [read_complete(os.path.join(directory, n)) for n in names if _STEP_DIR.match(n)]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def latest_checkpoint(directory: str) -> CheckpointInfo | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def latest_step(directory: str) -> int:
    """Step of the latest complete checkpoint, 0 when there is none."""
    c = latest_checkpoint(directory)
    return c.step if c else 0
