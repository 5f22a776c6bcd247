"""Document-aware batches: packing, length bucketing and token-budget batching; resumable and rank-sharded.

Documents longer than a row are cut into pieces of at most `seq_len` tokens (no token is dropped). Then:
- packing:   pieces are bin-packed (best fit, longest first) into rows of exactly `seq_len` slots. `doc_ids`
             mark the pieces of a row, so attention never crosses documents, positions restart and recurrent
             state resets; the last token of a piece predicts only within its own document.
- otherwise: one piece per row (padded at the end, which causal models never look at).
Rows form micro-batches: `microBatchSize` rows each, or as many rows as fit in `maxTokensPerBatch` padded
slots; with `bucketing` rows of similar length are grouped first, so padding per micro-batch stays small.

The list of micro-batches of an epoch is a pure function of (corpus, settings, seed, epoch), the same on every
rank. A step consumes `grad_accum x dp` consecutive micro-batches; rank r takes every dp-th one starting at r,
so ranks read disjoint data and the only state is (epoch, index): resume is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from seqtrain.data.batches import IGNORE_INDEX, Batch
from seqtrain.data.builtin import Corpus

_BUCKET_WINDOW = 64  # micro-batches' worth of rows sorted together when bucketing (keeps randomness across windows)


@dataclass
class Pieces:
    start: np.ndarray  # token offset of each piece in the corpus
    length: np.ndarray  # tokens in the piece (<= seq_len)
    doc_end: np.ndarray  # end offset of the piece's document: targets exist while index + 1 < doc_end


def split_documents(doc_starts: np.ndarray, total: int, max_len: int) -> Pieces:
    """Cut every document (>= 2 tokens) into consecutive pieces of at most `max_len` tokens."""
    starts = np.asarray(doc_starts, dtype=np.int64)
    ends = np.append(starts[1:], total).astype(np.int64)
    keep = ends - starts >= 2  # a 1-token document has nothing to predict
    starts, ends = starts[keep], ends[keep]
    counts = -(-(ends - starts) // max_len)
    doc = np.repeat(np.arange(len(starts)), counts)
    first_piece = np.repeat(np.cumsum(counts) - counts, counts)
    k = np.arange(len(doc)) - first_piece  # piece number within its document
    p_start = starts[doc] + k * max_len
    p_len = np.minimum(max_len, ends[doc] - p_start)
    return Pieces(start=p_start, length=p_len, doc_end=ends[doc])


def pack_rows(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing of piece lengths into rows of `capacity`; returns piece indices per row.

    Free space is indexed by its size (at most `capacity` distinct values), so each piece finds the tightest
    row that fits by scanning sizes upward from its own length.
    """
    order = np.argsort(-lengths, kind="stable")
    rows: list[list[int]] = []
    free: list[list[int]] = [[] for _ in range(capacity + 1)]  # free[r]: rows with r slots left
    for i in order.tolist():
        n = int(lengths[i])
        target = -1
        for r in range(n, capacity + 1):
            if free[r]:
                target = free[r].pop()
                left = r - n
                break
        if target < 0:
            target = len(rows)
            rows.append([])
            left = capacity - n
        rows[target].append(i)
        if left > 0:
            free[left].append(target)
    return rows


@dataclass
class RowPlan:
    pieces: Pieces
    row_ptr: np.ndarray  # row r holds pieces piece_idx[row_ptr[r]:row_ptr[r+1]]
    piece_idx: np.ndarray
    row_len: np.ndarray  # real tokens per row

    @property
    def num_rows(self) -> int:
        return len(self.row_len)


def plan_rows(corpus: Corpus, seq_len: int, packing: bool) -> RowPlan:
    pieces = split_documents(corpus.doc_starts, len(corpus), seq_len)
    if len(pieces.length) == 0:
        raise ValueError("the corpus has no document of 2 or more tokens")
    if packing:
        rows = pack_rows(pieces.length, seq_len)
        # order rows by their first piece so the plan does not depend on the packing's internal order
        rows.sort(key=lambda r: min(r))
        counts = np.array([len(r) for r in rows], dtype=np.int64)
        piece_idx = np.array([p for r in rows for p in sorted(r)], dtype=np.int64)
    else:
        counts = np.ones(len(pieces.length), dtype=np.int64)
        piece_idx = np.arange(len(pieces.length), dtype=np.int64)
    row_ptr = np.concatenate(([0], np.cumsum(counts)))
    row_len = np.add.reduceat(pieces.length[piece_idx], row_ptr[:-1])
    return RowPlan(pieces=pieces, row_ptr=row_ptr, piece_idx=piece_idx, row_len=row_len)


def build_batch(corpus: Corpus, plan: RowPlan, rows: np.ndarray, width: int, packing: bool) -> Batch:
    """Rows -> Batch [len(rows), width]: tokens, targets (IGNORE_INDEX where nothing is predicted), doc_ids."""
    b = len(rows)
    counts = plan.row_ptr[rows + 1] - plan.row_ptr[rows]
    sel = np.concatenate([plan.piece_idx[plan.row_ptr[r]:plan.row_ptr[r + 1]] for r in rows])
    p_len = plan.pieces.length[sel]
    p_row = np.repeat(np.arange(b), counts)
    # column where each piece begins inside its row
    row_first = np.repeat(np.cumsum(counts) - counts, counts)
    cum = np.cumsum(p_len) - p_len
    p_col = cum - cum[row_first]
    tok_piece = np.repeat(np.arange(len(sel)), p_len)
    within = np.arange(len(tok_piece)) - np.repeat(cum, p_len)
    src = plan.pieces.start[sel][tok_piece] + within
    r_idx, c_idx = p_row[tok_piece], p_col[tok_piece] + within

    tokens = np.zeros((b, width), dtype=np.int64)
    targets = np.full((b, width), IGNORE_INDEX, dtype=np.int64)
    tokens[r_idx, c_idx] = np.asarray(corpus.tokens[src], dtype=np.int64)
    has_next = src + 1 < plan.pieces.doc_end[sel][tok_piece]
    nxt = np.minimum(src + 1, len(corpus) - 1)
    if corpus.loss_mask is not None:
        has_next &= np.asarray(corpus.loss_mask[nxt], dtype=bool)
    tgt = np.asarray(corpus.tokens[nxt], dtype=np.int64)
    targets[r_idx[has_next], c_idx[has_next]] = tgt[has_next]
    doc_ids = None
    if packing:
        doc = np.full((b, width), -1, dtype=np.int64)  # padding: its own "document"
        doc[r_idx, c_idx] = (np.arange(len(sel)) - row_first)[tok_piece]
        doc_ids = torch.from_numpy(doc)
    return Batch(tokens=torch.from_numpy(tokens), targets=torch.from_numpy(targets), doc_ids=doc_ids)


class DocumentBatches:
    """Iterator over optimizer steps (this rank's `grad_accum` micro-batches), like `SequenceBatches`."""

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
        packing: bool = False,
        bucketing: bool = False,
        max_tokens_per_batch: int | None = None,
    ) -> None:
        if max_tokens_per_batch is not None and max_tokens_per_batch < seq_len:
            raise ValueError(f"spec.data.maxTokensPerBatch: {max_tokens_per_batch} cannot hold one sequence of "
                             f"{seq_len} tokens; use at least data.seqLen")
        self.corpus = corpus
        self.seq_len = seq_len
        self.micro = micro_batch_size
        self.accum = grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.packing, self.bucketing, self.budget = packing, bucketing, max_tokens_per_batch
        self.plan = plan_rows(corpus, seq_len, packing)
        self.epoch_index = 0
        self.index = 0  # next micro-batch within the epoch
        self._cache: tuple[int, list[np.ndarray]] | None = None
        if len(self._epoch(0)) == 0:
            raise ValueError(f"the corpus yields {self.plan.num_rows} rows, fewer than one micro-batch of "
                             f"{self.micro}; lower training.microBatchSize or add data")

    # ---- plan of an epoch --------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return self.plan.num_rows

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp_size

    def _width(self, rows: np.ndarray) -> int:
        return self.seq_len if self.packing else int(self.plan.row_len[rows].max())

    def _epoch(self, epoch: int) -> list[np.ndarray]:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n = self.plan.num_rows
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        lengths = self.plan.row_len
        if self.bucketing:
            per_batch = self.micro if self.budget is None else max(1, self.budget // self.seq_len)
            window = per_batch * _BUCKET_WINDOW
            order = np.concatenate([w[np.argsort(-lengths[w], kind="stable")]
                                    for w in np.array_split(order, max(1, -(-n // window)))])
        batches: list[np.ndarray] = []
        if self.budget is None:
            full = n // self.micro * self.micro  # an incomplete last micro-batch waits for the next epoch
            batches = [order[i:i + self.micro] for i in range(0, full, self.micro)]
        else:
            start, widest = 0, 0
            for i, r in enumerate(order.tolist()):
                w = self.seq_len if self.packing else int(lengths[r])
                if i > start and (i - start + 1) * max(widest, w) > self.budget:
                    batches.append(order[start:i])
                    start, widest = i, 0
                widest = max(widest, w)
            if start < n:
                batches.append(order[start:n])
        if self.bucketing and self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        self._cache = (epoch, batches)
        return batches

    # ---- iteration ---------------------------------------------------------------------------------------
    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step; advances the shared position by all ranks'."""
        out = []
        for k in range(self.accum * self.dp_size):
            epoch_batches = self._epoch(self.epoch_index)
            if self.index >= len(epoch_batches):
                self.epoch_index += 1
                self.index = 0
                epoch_batches = self._epoch(self.epoch_index)
            if k % self.dp_size == self.dp_rank:
                rows = epoch_batches[self.index]
                out.append(build_batch(self.corpus, self.plan, rows, self._width(rows), self.packing))
            self.index += 1
        return out

    def __iter__(self) -> Iterator[list[Batch]]:
        while True:
            yield self.next_step()

    @property
    def epoch(self) -> float:
        return self.epoch_index + self.index / max(1, len(self._epoch(self.epoch_index)))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch_index, "index": self.index, "rows": self.plan.num_rows, "seq_len": self.seq_len,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rows") != self.plan.num_rows or state.get("seq_len") != self.seq_len:
            raise ValueError(
                f"checkpoint data position is for {state.get('rows')} rows of {state.get('seq_len')} tokens, but "
                f"the data now gives {self.plan.num_rows} of {self.seq_len}: the data or data settings changed "
                "since the checkpoint; start a new workdir"
            )
        self.epoch_index, self.index = int(state["epoch"]), int(state["index"])
        self.seed = int(state.get("seed", self.seed))
        self._cache = None


def efficiency(batches: list[Batch]) -> float:
    """Real target tokens / token slots computed."""
    tokens = sum(int(b.num_targets()) for b in batches)
    slots = sum(b.slots for b in batches)
    return tokens / max(1, slots)
