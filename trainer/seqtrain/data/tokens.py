"""`data.source: tokens` over `seqtrain prepare-data` folders: memory-mapped shards with real document boundaries,
and blends of several such datasets with weights.

Each shard's documents (every one ending with the end-of-document token) are split per shard: the last
`validationFraction` of its documents are validation, the rest train (by tokens when the shard has too few
documents: `split_shard`). A blend draws documents from each dataset
so that its share of the epoch's tokens is its weight (seeded; a dataset whose share exceeds its size repeats).
The result is a `Corpus` whose `tokens` is a `DocumentView`: a virtual concatenation of the chosen documents that
reads only the positions asked for, so packing, bucketing and document masks work on billions of tokens without
loading them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from tokenize import TokenError
from typing import Any

import numpy as np

from seqtrain.data.builtin import Corpus
from seqtrain.data.prepare import INDEX
from seqtrain.runtime.exitcodes import InvalidConfig

_FIX = "run `seqtrain prepare-data` again into this folder"


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(path), INDEX))


INDEX_MAX_BYTES = 64 << 20  # an index lists each shard in about 100 bytes: far below this


def read_index(path: str) -> dict[str, Any]:
    """A prepared folder's index.json, checked for the fields the loader uses (InvalidConfig naming the file)."""
    where = os.path.join(os.path.expanduser(path), INDEX)
    try:
        with open(where, "rb") as f:
            raw = f.read(INDEX_MAX_BYTES + 1)
    except OSError as exc:
        raise InvalidConfig(f"{where}: cannot read: {exc.strerror}") from None
    if len(raw) > INDEX_MAX_BYTES:
        raise InvalidConfig(f"{where}: larger than {INDEX_MAX_BYTES >> 20} MiB: not a seqtrain-tokens index; {_FIX}")
    try:
        index = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser follows
        raise InvalidConfig(f"{where}: not JSON ({(str(exc).splitlines() or [type(exc).__name__])[0][:160]}); "
                            f"{_FIX}") from None
    if not isinstance(index, dict) or index.get("dtype") not in ("uint16", "uint32") \
            or not isinstance(index.get("shards"), list):
        raise InvalidConfig(f"{where}: not a seqtrain-tokens index (dtype uint16/uint32 and a shards list); {_FIX}")
    vocab = index.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 < vocab <= 2**32:
        raise InvalidConfig(f"{where}: vocab_size {_show(vocab)} must be a positive count of token ids; {_FIX}")
    if not isinstance(index.get("tokenizer"), dict | None):
        raise InvalidConfig(f"{where}: tokenizer must be an object saying how the folder was tokenized; {_FIX}")
    for i, shard in enumerate(index["shards"]):
        name = shard.get("name") if isinstance(shard, dict) else None
        if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", "..") \
                or "\0" in name:
            raise InvalidConfig(f"{where}: shards[{i}].name {_show(name)} must be a file name in the folder (no "
                                f"path, no ..); {_FIX}")
        tokens = shard.get("tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise InvalidConfig(f"{where}: shards[{i}].tokens {_show(tokens)} must be a count of tokens; {_FIX}")
    return index


def _show(value: Any) -> str:
    """A value from a file for a message: scalars shown (shortened), containers by their type only."""
    if isinstance(value, str | int | float | bool | None):
        return repr(value)[:80]
    return f"a {type(value).__name__}"


def _doc_starts(base: str, n: int) -> np.ndarray:
    """A shard's document offsets: 1-D integers, starting at 0, increasing, all inside the shard's n tokens."""
    path = base + ".docs.npy"
    try:
        # mapped, not read: a header that declares more entries than the file holds is refused by the mapping
        # instead of allocating them
        mapped = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError, SyntaxError, TypeError, RecursionError, TokenError) as exc:
        # numpy parses the header as a Python literal: a damaged one raises what parsing raises
        raise InvalidConfig(f"{path}: unreadable ({(str(exc).splitlines() or [type(exc).__name__])[0][:160]}); "
                            f"{_FIX}") from None
    if not isinstance(mapped, np.ndarray) or mapped.ndim != 1 or mapped.dtype.kind not in "iu" \
            or not 0 < len(mapped) <= n:
        raise InvalidConfig(f"{path}: not a 1-D integer array of at most {n} document offsets; {_FIX}")
    starts = np.asarray(mapped, dtype=np.int64).copy()
    del mapped
    if starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= n:
        bad = int(starts.max())
        raise InvalidConfig(f"{path}: document offsets must start at 0, increase and stay below the shard's {n} "
                            f"tokens (largest {bad}); the shard and its offsets do not match; {_FIX}")
    return starts


class DocumentView:
    """Documents (source array, start, length) seen as one 1-D token array; `[idx]` gathers only those tokens."""

    def __init__(self, sources: Sequence[np.ndarray], src: np.ndarray, start: np.ndarray, length: np.ndarray,
                 dtype: np.dtype) -> None:
        self.sources = list(sources)
        self.src, self.start, self.length = src, start, length
        self.vstart = np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64)
        self.dtype = dtype
        self.shape = (int(length.sum()),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: Any) -> np.ndarray:
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(len(self)))
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError("token index out of range")
        flat = idx.reshape(-1)
        doc = np.searchsorted(self.vstart, flat, side="right") - 1
        pos = self.start[doc] + (flat - self.vstart[doc])
        src = self.src[doc]
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(src):
            sel = src == s
            out[sel] = self.sources[s][pos[sel]]
        return out.reshape(idx.shape)


def _mask(base: str, n: int) -> np.ndarray:
    """A chat shard's assistant mask (prepare-data --format chat): one uint8 per token, mapped."""
    path = base + ".mask.bin"
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise InvalidConfig(f"{path}: cannot read: {exc.strerror}; index.json says the shards carry a loss mask; "
                            f"{_FIX}") from None
    if size != n:
        raise InvalidConfig(f"{path}: {size} bytes, but its shard has {n} tokens (one byte each): truncated or "
                            f"replaced; {_FIX}")
    try:
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(n,))
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{path}: cannot be mapped ({exc}); {_FIX}") from None


def _dataset_docs(path: str, split: str, fraction: float, src_base: int
                  ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray, dict[str, Any], list[np.ndarray]]:
    """(shard memmaps, src, start, length, index, mask memmaps) of one prepared dataset's split (masks: a chat
    dataset's assistant masks; every token scored otherwise)."""
    index = read_index(path)
    dtype = np.dtype(index["dtype"])
    masked = index.get("loss_mask") is True
    maps, srcs, starts, lengths, masks = [], [], [], [], []
    for shard in index["shards"]:
        n = int(shard["tokens"])
        if n == 0:
            continue
        base = os.path.join(os.path.expanduser(path), shard["name"])
        try:
            size = os.path.getsize(base + ".bin")
        except OSError as exc:
            raise InvalidConfig(f"{base}.bin: cannot read: {exc.strerror}; {_FIX}") from None
        if size != n * dtype.itemsize:
            raise InvalidConfig(f"{base}.bin: {size} bytes, but index.json says {n} tokens of {dtype.name} "
                                f"({n * dtype.itemsize} bytes): truncated or replaced; {_FIX}")
        try:
            mm = np.memmap(base + ".bin", dtype=dtype, mode="r", shape=(n,))
        except (OSError, ValueError) as exc:  # a folder or a special file in the shard's place
            raise InvalidConfig(f"{base}.bin: cannot be mapped ({exc}); {_FIX}") from None
        s, e = split_shard(_doc_starts(base, n), n, fraction, split)
        if len(s) == 0:
            continue
        srcs.append(np.full(len(s), src_base + len(maps), dtype=np.int64))
        maps.append(mm)
        masks.append(_mask(base, n) if masked else np.broadcast_to(np.uint8(1), (n,)))
        starts.append(s.astype(np.int64))
        lengths.append((e - s).astype(np.int64))
    if not maps:
        return [], np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), index, []
    return maps, np.concatenate(srcs), np.concatenate(starts), np.concatenate(lengths), index, masks


def split_shard(doc_starts: np.ndarray, n: int, fraction: float, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of one shard's documents in a split: the last `fraction` of its documents are validation.
    A shard with too few documents for that (one large text is one document) is split by tokens instead: the
    last `fraction` of its tokens are validation, and the document the cut falls in becomes two pieces."""
    ends = np.append(doc_starts[1:], n)
    held = int(round(len(doc_starts) * fraction))
    if held == 0 and fraction > 0:
        cut = n - int(round(n * fraction))
        keep = doc_starts < cut if split == "train" else ends > cut
        if split == "train":
            return doc_starts[keep], np.minimum(ends[keep], cut)
        return np.maximum(doc_starts[keep], cut), ends[keep]
    sel = slice(0, len(doc_starts) - held) if split == "train" else slice(len(doc_starts) - held, None)
    return doc_starts[sel], ends[sel]


def blend_counts(lengths: Sequence[np.ndarray], weights: Sequence[float], rng: np.random.Generator
                 ) -> list[np.ndarray]:
    """Per dataset, the document indices of one blended epoch: dataset i contributes about weights[i] of the
    tokens. The epoch has as many tokens as all datasets together; a dataset is repeated whole as often as its
    share needs, then topped up with a random subset of its documents."""
    total = float(sum(int(x.sum()) for x in lengths))
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    out = []
    for lens, share in zip(lengths, w, strict=True):
        want = share * total
        size = float(lens.sum())
        whole = int(want // size)
        picks = [np.tile(np.arange(len(lens)), whole)] if whole else []
        rest = want - whole * size
        if rest > 0:
            order = rng.permutation(len(lens))
            take = int(np.searchsorted(np.cumsum(lens[order]), rest)) + 1
            picks.append(np.sort(order[:min(take, len(lens))]))
        out.append(np.concatenate(picks) if picks else np.empty(0, np.int64))
    return out


def load_prepared(paths: Sequence[str], weights: Sequence[float] | None, split: str, fraction: float,
                  seed: int = 0) -> Corpus:
    """The corpus of one split over prepared datasets (blended by `weights` when given)."""
    sources: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    masked = False
    per: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    dtypes = []
    for path in paths:
        maps, src, start, length, index, mask = _dataset_docs(path, split, fraction, len(sources))
        sources += maps
        masks += mask
        masked |= index.get("loss_mask") is True
        per.append((src, start, length))
        dtypes.append(np.dtype(index["dtype"]))
    if not any(len(p[0]) for p in per):
        raise ValueError(f"spec.data.paths: the prepared datasets hold no {split} documents "
                         f"(validationFraction {fraction})")
    dtype = np.uint32 if any(d == np.uint32 for d in dtypes) else np.uint16
    if weights is not None and len(paths) > 1:
        rng = np.random.default_rng([seed, 0 if split == "train" else 1])
        picks = blend_counts([p[2] for p in per], weights, rng)
        per = [(s[k], st[k], ln[k]) for (s, st, ln), k in zip(per, picks, strict=True)]
    src = np.concatenate([p[0] for p in per])
    start = np.concatenate([p[1] for p in per])
    length = np.concatenate([p[2] for p in per])
    if weights is not None and len(paths) > 1:  # interleave the datasets' documents (seeded, resumable)
        order = np.random.default_rng([seed, 2]).permutation(len(src))
        src, start, length = src[order], start[order], length[order]
    view = DocumentView(sources, src, start, length, np.dtype(dtype))
    # chat datasets score only assistant tokens: the mask is read through the same documents as the tokens
    loss_mask = DocumentView(masks, src, start, length, np.dtype(np.uint8)) if masked else None
    return Corpus(tokens=view, doc_starts=view.vstart.copy(), loss_mask=loss_mask)  # type: ignore[arg-type]


def prepared_vocab(paths: Sequence[str]) -> int | None:
    sizes = [int(read_index(p)["vocab_size"]) for p in paths if is_prepared(p)]
    return max(sizes) if sizes else None


def prepared_tokenizer(paths: Sequence[str]) -> dict[str, Any] | None:
    for p in paths:
        if is_prepared(p):
            return dict(read_index(p).get("tokenizer") or {})
    return None
