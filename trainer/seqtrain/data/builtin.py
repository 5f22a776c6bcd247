"""The built-in corpus: the running Python's standard-library `.py` sources, read as bytes (no network).

Split into train and validation per file by a hash of its path relative to the stdlib root, so the split is
the same on every rank and every run, and a file never lands on both sides.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

from seqtrain.spec.datafiles import in_validation  # one split rule for every source and for validate

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    """All documents of one split concatenated; `doc_starts[i]` is where document i begins in `tokens`."""

    tokens: np.ndarray  # uint8 (bytes) or a wider int type for other tokenizers
    doc_starts: np.ndarray  # int64, ascending, first is 0
    # Optional, per token: does predicting this token count in the loss? (synthetic tasks score only answers)
    loss_mask: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of every stdlib `.py` file, sorted (the order is part of the data contract)."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    return sorted(out)


@functools.lru_cache(maxsize=4)  # train + validation, read once per process (about 30 MB, read-only arrays)
def load_builtin(split: str, validation_fraction: float, root: str | None = None) -> Corpus:
    if split not in ("train", "validation"):
        raise ValueError(f"split must be train or validation, not {split!r}")
    root = root or stdlib_root()
    want_val = split == "validation"
    chunks: list[bytes] = []
    for rel in stdlib_files(root):
        if in_validation(rel, validation_fraction) != want_val:
            continue
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
        except OSError:
            continue  # unreadable file (permissions): skipping it keeps the split stable across ranks
        if data:
            chunks.append(data)
    if not chunks:
        raise RuntimeError(f"the built-in corpus has no {split} files under {root}")
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return Corpus(tokens=tokens, doc_starts=starts)
