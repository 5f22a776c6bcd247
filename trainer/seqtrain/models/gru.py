"""Stacked GRU language model: embedding -> single-layer `nn.GRU` modules (dropout between) -> RMSNorm.

Packing (documents regrouped so each starts from a zero state) and time-chunk activation checkpointing come
from `RecurrentLM`. Layers are separate modules in `self.layers` so pipeline stages can split them.
"""

from __future__ import annotations

import torch
from torch import nn

from seqtrain.models.recurrent import RecurrentLM
from seqtrain.spec.model import ModelSpec


class GRULM(RecurrentLM):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        assert spec.dim and spec.layers
        self.layers = nn.ModuleList(nn.GRU(spec.dim, spec.dim, batch_first=True) for _ in range(spec.layers))
        self._init_embeddings()

    def init_state(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(like.new_zeros(batch, self.spec.dim) for _ in self.layers)

    def stack(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], reset: torch.Tensor | None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        new_state = []
        for i, (layer, h) in enumerate(zip(self.layers, state, strict=True)):
            # nn.GRU wants [layers, batch, dim]; under autocast its output may be half precision, the
            # carried state stays in the input's dtype so every chunk sees the same types.
            x, h_out = layer(x, h.unsqueeze(0).to(x.dtype))
            new_state.append(h_out.squeeze(0).to(h.dtype))
            if i < len(self.layers) - 1:
                x = self.drop(x)
        return x, tuple(new_state)
