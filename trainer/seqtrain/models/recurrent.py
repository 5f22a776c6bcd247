"""Shared machinery of the recurrent language models (LSTM, GRU, QRNN): packed documents and time chunks.

Packed rows (several documents per row, `doc_ids`) must not leak recurrent state from one document into the
next. Models whose recurrence is a fused kernel (`nn.GRU`, `nn.LSTM`) cannot reset their state mid-sequence,
so the rows are regrouped into one sequence per document (`DocumentLayout`: [documents, longest], sorted
longest first), run from a zero state, and scattered back. Processing goes in time chunks; a document that
has ended drops out of the batch (like `PackedSequence`), so padding costs at most one chunk per document.

Activation checkpointing for recurrent models (`ac_time_chunks`, set by
`seqtrain.models.activation_checkpointing.apply_activation_checkpointing`) runs the whole stack — embedding included — per
time chunk under one checkpoint: what stays stored is the token ids and the recurrent state at each chunk
boundary, about sqrt(T) states instead of T time steps of every layer's internals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from seqtrain.models.activation_checkpointing import checkpoint
from seqtrain.models.layers import RMSNorm, document_positions
from seqtrain.spec.model import ModelSpec

# Time-chunk length when regrouped documents run without checkpointing: finished documents leave the
# batch at chunk boundaries, so shorter chunks waste less compute on padding but launch more kernels.
_DOC_CHUNK = 32


@dataclass
class DocumentLayout:
    """Where each token of a [B, T] batch lives in the [N, L] one-document-per-row layout."""

    row: torch.Tensor  # [B*T] document index (0 = longest)
    pos: torch.Tensor  # [B*T] position inside the document
    lengths: list[int]  # host copy, longest first
    batch_shape: tuple[int, int]

    @staticmethod
    def from_doc_ids(doc_ids: torch.Tensor) -> DocumentLayout:
        b, t = doc_ids.shape
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        flat_starts = starts.reshape(-1)
        seg = torch.cumsum(flat_starts.long(), 0) - 1  # segment id per token, in row-major order
        start_idx = flat_starts.nonzero().squeeze(1)
        lengths = torch.diff(start_idx, append=torch.tensor([b * t], device=doc_ids.device))
        order = torch.argsort(lengths, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        # Host sync: the chunk loop needs how many documents are still active at each time step.
        host_lengths = lengths[order].tolist()
        return DocumentLayout(row=rank[seg], pos=document_positions(doc_ids).reshape(-1),
                              lengths=host_lengths, batch_shape=(b, t))

    def gather(self, x: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """[B, T, ...] -> [N, L, ...] (positions past a document's end hold `fill`)."""
        flat = x.reshape(-1, *x.shape[2:])
        out = flat.new_full((len(self.lengths), self.lengths[0], *x.shape[2:]), fill)
        out[self.row, self.pos] = flat
        return out

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] -> [B, T, ...] (differentiable: a gather)."""
        return y[self.row, self.pos].reshape(*self.batch_shape, *y.shape[2:])


class RecurrentLM(nn.Module):
    """embedding -> recurrent layers (dropout between) -> RMSNorm -> hidden; `output_weight` for the loss.

    Subclasses define `layers`, `init_state(batch, like)` (a tuple of [batch, ...] tensors per model) and
    `stack(x, state, reset)` running every layer on one time chunk. `needs_regroup`: the recurrence cannot
    reset its state at document starts by itself (fused cuDNN/oneDNN kernels).
    """

    supports_time_chunks = True
    needs_regroup = True

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        assert spec.vocab_size and spec.dim and spec.layers, "resolve() the spec"
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.dim)
        self.drop = nn.Dropout(spec.dropout)
        self.norm = RMSNorm(spec.dim, spec.norm_eps)
        self.lm_head = None if spec.tie_embeddings else nn.Linear(spec.dim, spec.vocab_size, bias=False)
        # Set by activation checkpointing: run over this many time chunks, each under a checkpoint.
        self.ac_time_chunks: int | None = None
        self.ac_checkpoint = True  # False: same chunking without recomputation (tests compare the two)

    def _init_embeddings(self) -> None:
        nn.init.normal_(self.embed.weight, 0.0, self.spec.init_std)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, 0.0, self.spec.init_std)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    # --- subclass interface -------------------------------------------------------------------------------
    def init_state(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def stack(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], reset: torch.Tensor | None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        raise NotImplementedError

    # --- shared forward -----------------------------------------------------------------------------------
    def _chunk(self, tokens: torch.Tensor, reset: torch.Tensor | None, *state: torch.Tensor
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        x = self.drop(self.embed(tokens))
        return self.stack(x, tuple(state), reset)

    def _run(self, tokens: torch.Tensor, reset: torch.Tensor | None, lengths: list[int] | None) -> torch.Tensor:
        """tokens [N, L] (documents sorted longest first when `lengths` is given) -> hidden [N, L, D]."""
        n, t = tokens.shape
        use_ckpt = self.ac_time_chunks is not None and self.ac_checkpoint and torch.is_grad_enabled()
        if self.ac_time_chunks is not None:
            size = max(1, math.ceil(t / self.ac_time_chunks))
        elif lengths is not None:
            size = _DOC_CHUNK
        else:
            size = t
        probe = self.embed.weight
        state = self.init_state(n, probe)
        outs = []
        for t0 in range(0, t, size):
            t1 = min(t, t0 + size)
            # documents still running at t0 (sorted longest first, so a prefix)
            active = n if lengths is None else sum(1 for length in lengths if length > t0)
            state = tuple(s[:active] for s in state)
            tok = tokens[:active, t0:t1]
            rs = None if reset is None else reset[:active, t0:t1]
            if use_ckpt:
                out, state = checkpoint(self._chunk, tok, rs, *state)
            else:
                out, state = self._chunk(tok, rs, *state)
            if active < n:
                out = F.pad(out, (0, 0, 0, 0, 0, n - active))
            outs.append(out)
        return torch.cat(outs, dim=1)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> hidden [B, T, D]; with doc_ids each document starts from a zero state."""
        if doc_ids is None:
            return self.norm(self._run(tokens, None, None))
        if not self.needs_regroup:
            reset = torch.zeros_like(doc_ids, dtype=torch.bool)
            reset[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
            return self.norm(self._run(tokens, reset, None))
        layout = DocumentLayout.from_doc_ids(doc_ids)
        hidden = self._run(layout.gather(tokens), None, layout.lengths)
        return self.norm(layout.scatter(hidden))
