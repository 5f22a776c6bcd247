"""Stacked LSTM language model: embedding -> LSTM layers (dropout between) -> RMSNorm -> hidden.

Layers are separate single-layer `nn.LSTM` modules in `self.layers` so activation checkpointing over time
chunks and pipeline stages can treat them one at a time. The output projection is `output_weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from seqtrain.models.recurrent import RecurrentLM
from seqtrain.spec.model import ModelSpec


class LSTMLM(RecurrentLM):
    """Packed documents (state reset per document) and time-chunk checkpointing come from `RecurrentLM`."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)  # embed, drop, norm, lm_head
        assert spec.dim and spec.layers
        self.layers = nn.ModuleList(nn.LSTM(spec.dim, spec.dim, batch_first=True) for _ in range(spec.layers))
        self._init_embeddings()
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

    def init_state(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # per layer: hidden and cell state
        return tuple(like.new_zeros(batch, self.spec.dim) for _ in range(2 * len(self.layers)))

    def stack(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], reset: torch.Tensor | None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        new_state: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h, c = state[2 * i], state[2 * i + 1]
            # nn.LSTM wants [layers, batch, dim]; the carried state keeps the input's dtype under autocast.
            x, (h_out, c_out) = layer(x, (h.unsqueeze(0).to(x.dtype), c.unsqueeze(0).to(x.dtype)))
            new_state += [h_out.squeeze(0).to(h.dtype), c_out.squeeze(0).to(c.dtype)]
            if i < len(self.layers) - 1:
                x = self.drop(x)
        return x, tuple(new_state)
