"""Loading checkpoint files from storage that others may write (a shared PVC): tensors and plain values only.

Every file seqtrain itself writes holds tensors, numbers, strings, lists and dicts, so it loads with
`torch.load(..., weights_only=True)`: a pickle that names any other class or function (a planted payload) is
refused before anything of it runs. A refused or unreadable file is reported as `UnusableCheckpoint` naming the
file; the trainer then falls back to the previous complete checkpoint (see `Trainer.resume`).
"""

from __future__ import annotations

import os
import pickle
import zipfile
from typing import Any

import torch

from seqtrain.runtime.exitcodes import InvalidConfig


class UnusableCheckpoint(Exception):
    """A checkpoint file that must not (unsafe) or cannot (corrupt) be loaded; the message names it and why."""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def load_plain(path: str, map_location: Any = None) -> Any:
    """torch.load with weights_only=True; a refused or unreadable file raises UnusableCheckpoint naming it."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnusableCheckpoint(f"{path}: refused: it holds objects other than tensors and plain values "
                                 f"(tampered, or not written by seqtrain): {_first_line(exc)}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as exc:
        raise UnusableCheckpoint(f"{path}: unreadable (truncated or corrupt): {_first_line(exc)}") from None


def require_layout(directory: str, engine: str, **layout: int) -> None:
    """Before a library unpickles its own files fully (DeepSpeed's shards, DCP's .metadata): the checkpoint's
    meta.json must name this engine and these layout degrees (dp/tp/pp given as keywords), so such a load runs
    only on a checkpoint this job's own engine published. Its file sizes were checked by discovery already.
    A mismatch is the job's change, not damage: InvalidConfig (the job fails at once, the checkpoint is kept)."""
    import json

    path = os.path.join(directory, "meta.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise UnusableCheckpoint(f"{path}: unreadable: {_first_line(exc)}") from None
    if meta.get("engine") != engine:
        raise InvalidConfig(f"{path}: written by engine {meta.get('engine')!r}, but this job runs {engine!r}: "
                            "resume with the engine in its meta.json, or use a new checkpoint folder")
    saved = meta.get("layout") or {}
    for key, want in layout.items():
        if saved.get(key) != want:
            raise InvalidConfig(f"{path}: layout {key}={saved.get(key)} but this job runs {key}={want}: resume "
                                "with the layout in its meta.json, or use a new checkpoint folder")
