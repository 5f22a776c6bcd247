"""Synthetic sequence tasks whose loss shows whether a model really learns (not just token statistics).

Symbols are ids 0 .. V-1 (`data.synthetic.vocab`); four special ids follow: BOS = V, SEP = V+1, QUERY = V+2,
EOS = V+3, so the vocabulary is V + 4 (what `seqtrain.spec.resolve` assumes). Only the answer tokens are
scored (`Corpus.loss_mask`), so chance level is known exactly:
- copy:   BOS s_1..s_n SEP s_1..s_n EOS       scored: the copy and EOS; chance accuracy 1/V per symbol.
- recall: BOS k_1 v_1 .. k_m v_m QUERY k_j v_j EOS   keys are distinct symbols from the first half, values
          from the second half; scored: v_j; chance accuracy 2/V (m = n // 2 pairs).
"""

from __future__ import annotations

import numpy as np

from seqtrain.data.builtin import Corpus
from seqtrain.spec.data import SyntheticSpec

SPECIALS = 4


def special_ids(vocab: int) -> dict[str, int]:
    return {"bos": vocab, "sep": vocab + 1, "query": vocab + 2, "eos": vocab + 3}


def example_length(spec: SyntheticSpec) -> int:
    if spec.task == "copy":
        return 2 * spec.length + 3
    return 2 * (spec.length // 2) + 5


def check(spec: SyntheticSpec) -> None:
    if spec.task == "recall" and spec.length // 2 > spec.vocab // 2:
        raise ValueError(f"spec.data.synthetic.length: recall needs distinct keys; {spec.length // 2} pairs do not "
                         f"fit in {spec.vocab // 2} key symbols; use length <= {spec.vocab // 2 * 2} or more vocab")
    if spec.task == "recall" and spec.length < 2:
        raise ValueError("spec.data.synthetic.length: recall needs at least one key-value pair (length >= 2)")


def generate(spec: SyntheticSpec, num_examples: int, seed: int) -> Corpus:
    """`num_examples` examples drawn from a seeded generator, concatenated; each example is one document."""
    check(spec)
    rng = np.random.default_rng(seed)
    v, n = spec.vocab, spec.length
    sp = special_ids(v)
    col = lambda value: np.full((num_examples, 1), value, dtype=np.int64)  # noqa: E731
    if spec.task == "copy":
        s = rng.integers(0, v, size=(num_examples, n))
        rows = np.concatenate([col(sp["bos"]), s, col(sp["sep"]), s, col(sp["eos"])], axis=1)
        mask = np.zeros_like(rows, dtype=bool)
        mask[:, n + 2:] = True  # the copy and the EOS
    else:
        m = n // 2
        half = v // 2
        keys = np.argsort(rng.random((num_examples, half)), axis=1)[:, :m]  # distinct keys per example
        vals = rng.integers(half, v, size=(num_examples, m))
        pairs = np.stack([keys, vals], axis=2).reshape(num_examples, 2 * m)
        j = rng.integers(0, m, size=num_examples)
        ar = np.arange(num_examples)
        rows = np.concatenate([col(sp["bos"]), pairs, col(sp["query"]), keys[ar, j][:, None], vals[ar, j][:, None],
                               col(sp["eos"])], axis=1)
        mask = np.zeros_like(rows, dtype=bool)
        mask[:, -2] = True  # the recalled value
    length = rows.shape[1]
    starts = np.arange(num_examples, dtype=np.int64) * length
    return Corpus(tokens=rows.reshape(-1).astype(np.int32), doc_starts=starts, loss_mask=mask.reshape(-1))


def load_synthetic(spec: SyntheticSpec, split: str, seed: int, num_examples: int | None = None) -> Corpus:
    """Train and validation come from different seeds (never the same example stream)."""
    count = num_examples or (20_000 if split == "train" else 512)
    return generate(spec, count, seed=_split_seed(seed, split))


def _split_seed(seed: int, split: str) -> int:
    return seed * 2 + (1 if split == "validation" else 0)
