"""Stacked LSTM language model: embedding -> LSTM layers (dropout between) -> RMSNorm -> hidden.

Layers are separate single-layer `nn.LSTM` modules in `self.layers` so activation checkpointing over time
chunks and pipeline stages can treat them one at a time. The output projection is `output_weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from seqtrain.spec.model import ModelSpec

from .layers import RMSNorm


class LSTMLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        assert spec.vocab_size and spec.dim and spec.layers, "resolve() the spec"
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.dim)
        self.layers = nn.ModuleList(nn.LSTM(spec.dim, spec.dim, batch_first=True) for _ in range(spec.layers))
        self.drop = nn.Dropout(spec.dropout)
        self.norm = RMSNorm(spec.dim, spec.norm_eps)
        self.lm_head = None if spec.tie_embeddings else nn.Linear(spec.dim, spec.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, 0.0, spec.init_std)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, 0.0, spec.init_std)
        for layer in self.layers:
            # forget-gate bias 1: remember by default early in training (Jozefowicz et al. 2015)
            for name, p in layer.named_parameters():
                if name.startswith("bias_ih"):
                    with torch.no_grad():
                        p.zero_()
                        p[spec.dim : 2 * spec.dim].fill_(1.0)
                elif name.startswith("bias_hh"):
                    with torch.no_grad():
                        p.zero_()

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> hidden [B, T, D]; every sequence starts from a zero state."""
        if doc_ids is not None and bool((doc_ids[:, 1:] != doc_ids[:, :-1]).any()):
            # Resetting the state mid-sequence needs a custom recurrence; until then refuse rather than leak.
            raise NotImplementedError("packed sequences (several documents per row) are not supported by lstm yet")
        x = self.drop(self.embed(tokens))
        for i, layer in enumerate(self.layers):
            x, _ = layer(x)
            if i < len(self.layers) - 1:
                x = self.drop(x)
        return self.norm(x)
