"""Resumable, rank-sharded batches of fixed-length sequences.

The corpus is cut into windows of `seq_len + 1` tokens (stride `seq_len`); each epoch visits them in a seeded
permutation. The only state is one global cursor (sequences consumed by all ranks), so a resumed run, or a run
with a different dp x accumulation split of the same global batch, sees exactly the same sequences per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from seqtrain.data.builtin import Corpus

IGNORE_INDEX = -100


@dataclass
class Batch:
    """One micro-batch. `targets` is `tokens` shifted by one, IGNORE_INDEX where there is nothing to predict."""

    tokens: torch.Tensor  # [B, T] int64
    targets: torch.Tensor  # [B, T] int64
    doc_ids: torch.Tensor | None = None  # [B, T] int64, packing only

    @property
    def slots(self) -> int:
        """Token positions computed, padding included."""
        return self.tokens.numel()

    def num_targets(self) -> torch.Tensor:
        """Non-padding target tokens, as a tensor on the batch's device (no host sync)."""
        return self.targets.ne(IGNORE_INDEX).sum()

    def to(self, device: torch.device | str) -> Batch:
        nb = device != "cpu" and torch.device(device).type == "cuda"
        return replace(
            self,
            tokens=self.tokens.to(device, non_blocking=nb),
            targets=self.targets.to(device, non_blocking=nb),
            doc_ids=None if self.doc_ids is None else self.doc_ids.to(device, non_blocking=nb),
        )


def window_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    rows = torch.from_numpy(tokens[idx].astype(np.int64))
    return Batch(tokens=rows[:, :-1].contiguous(), targets=rows[:, 1:].contiguous())


class SequenceBatches:
    """Iterator over optimizer steps: each item is this rank's list of `grad_accum` micro-batches."""

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        micro_batch_size: int,
        grad_accum: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.tokens = corpus.tokens
        self.seq_len = seq_len
        self.micro = micro_batch_size
        self.accum = grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.num_sequences = (len(corpus) - 1) // seq_len
        if self.num_sequences < 1:
            raise ValueError(f"corpus of {len(corpus)} tokens is shorter than one sequence of {seq_len + 1}")
        self.cursor = 0  # sequences consumed globally (all ranks, all steps)
        self._epoch_order: tuple[int, np.ndarray] | None = None

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp_size

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            n = self.num_sequences
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def _sequence_starts(self, first: int, count: int) -> np.ndarray:
        """Token offsets of global sequence positions first .. first+count-1 (crossing epochs as needed)."""
        pos = np.arange(first, first + count)
        epochs, within = np.divmod(pos, self.num_sequences)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._order(int(e))[within[sel]]
        return out * self.seq_len

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step; advances the global cursor by one batch."""
        batches = []
        for m in range(self.accum):
            first = self.cursor + (m * self.dp_size + self.dp_rank) * self.micro
            batches.append(window_batch(self.tokens, self._sequence_starts(first, self.micro), self.seq_len))
        self.cursor += self.global_batch
        return batches

    def __iter__(self) -> Iterator[list[Batch]]:
        while True:
            yield self.next_step()

    @property
    def epoch(self) -> float:
        return self.cursor / self.num_sequences

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "seed": self.seed, "num_sequences": self.num_sequences,
                "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_sequences") != self.num_sequences or state.get("seq_len") != self.seq_len:
            raise ValueError(
                f"checkpoint data position is for {state.get('num_sequences')} sequences of {state.get('seq_len')} "
                f"tokens, but this corpus has {self.num_sequences} of {self.seq_len}: the data changed since the "
                "checkpoint (another Python version or data.seqLen); start a new workdir"
            )
        self.cursor = int(state["cursor"])
        self.seed = int(state.get("seed", self.seed))
        self._epoch_order = None


def eval_batches(
    corpus: Corpus, seq_len: int, micro_batch_size: int, num_batches: int, dp_rank: int = 0, dp_size: int = 1
) -> Iterator[Batch]:
    """The first `num_batches` micro-batches of this rank, in corpus order (the same every evaluation).

    Wraps around a validation split smaller than the request."""
    n = max(1, (len(corpus) - 1) // seq_len)
    for b in range(num_batches):
        first = (b * dp_size + dp_rank) * micro_batch_size
        pos = np.arange(first, first + micro_batch_size) % n
        yield window_batch(corpus.tokens, pos * seq_len, seq_len)
