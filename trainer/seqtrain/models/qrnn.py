"""Quasi-recurrent network (Bradbury et al. 2017): causal convolution + fo-pooling, no recurrent matmul.

Per layer, from the input x_t and the previous input x_{t-1} (a width-2 causal convolution):
    z_t = tanh(W_z [x_t; x_{t-1}]),  f_t = sigmoid(W_f [...]),  o_t = sigmoid(W_o [...])
    c_t = f_t * c_{t-1} + (1 - f_t) * z_t        (fo-pooling: a first-order linear recurrence)
    h_t = o_t * c_t
The pooling is exactly `linear_scan(a=f, b=(1-f)*z, h0=c_{-1})`, `h_t = a_t h_{t-1} + b_t`: with
`optimization.kernels` on (`QRNNLayer.use_kernels`) it runs as `seqtrain.kernels.linear_scan` (Triton), otherwise
as the reference scan below. At a document start (packing) the convolution
sees a zero x_{t-1} and a_t = 0 drops c_{t-1}: the state resets with plain masks, no regrouping needed.
"""

from __future__ import annotations

import torch
from torch import nn

from seqtrain.models.recurrent import RecurrentLM
from seqtrain.spec.model import ModelSpec


def reference_linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """h_t = a_t * h_{t-1} + b_t along dim 1 of [batch, seq, dim] (Hillis-Steele doubling, autograd-friendly)."""
    if h0 is not None:
        b = torch.cat((b[:, :1] + a[:, :1] * h0.unsqueeze(1), b[:, 1:]), dim=1)
    shift, seq = 1, a.shape[1]
    while shift < seq:
        b = torch.cat((b[:, :shift], b[:, shift:] + a[:, shift:] * b[:, :-shift]), dim=1)
        a = torch.cat((a[:, :shift], a[:, shift:] * a[:, :-shift]), dim=1)
        shift *= 2
    return b


def linear_scan(
    a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None, *, kernels: bool = False
) -> torch.Tensor:
    """`seqtrain.kernels.linear_scan` (dispatching per call) with `kernels`, else the reference above."""
    if kernels:
        from seqtrain.kernels import linear_scan as kernel_scan  # never imports triton by itself

        return kernel_scan(a, b, h0)
    return reference_linear_scan(a, b, h0)


class QRNNLayer(nn.Module):
    use_kernels = False  # per instance: seqtrain.models.dispatch.apply_kernels

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.proj = nn.Linear(2 * dim, 3 * dim)  # [x_t; x_{t-1}] -> z, f, o

    def forward(self, x: torch.Tensor, prev_x: torch.Tensor, c0: torch.Tensor, reset: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, t, D]; prev_x, c0 [B, D] carried from the previous chunk; reset [B, t] True at document starts."""
        shifted = torch.cat((prev_x.unsqueeze(1).to(x.dtype), x[:, :-1]), dim=1)
        if reset is not None:
            shifted = shifted.masked_fill(reset.unsqueeze(-1), 0.0)
        z, f, o = self.proj(torch.cat((x, shifted), dim=-1)).chunk(3, dim=-1)
        # The scan runs in fp32 even under autocast: a product of many gates underflows quickly in half.
        f = torch.sigmoid(f.float())
        a = f if reset is None else f.masked_fill(reset.unsqueeze(-1), 0.0)
        c = linear_scan(a, (1.0 - f) * torch.tanh(z.float()), c0.float(), kernels=self.use_kernels)
        h = torch.sigmoid(o.float()) * c
        # clone: a view would keep the whole chunk's x and c alive as the next chunk's (checkpointed) input
        return h.to(x.dtype), x[:, -1].clone(), c[:, -1].clone()


class QRNNLM(RecurrentLM):
    needs_regroup = False  # resets are masks inside the layer

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        assert spec.dim and spec.layers
        self.layers = nn.ModuleList(QRNNLayer(spec.dim) for _ in range(spec.layers))
        self._init_embeddings()
        for layer in self.layers:
            with torch.no_grad():
                # forget-gate bias +1: keep the cell state by default early in training
                layer.proj.bias.zero_()
                layer.proj.bias[spec.dim:2 * spec.dim].fill_(1.0)

    def init_state(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # per layer: previous input (for the convolution) and cell state
        return tuple(like.new_zeros(batch, self.spec.dim) for _ in range(2 * len(self.layers)))

    def stack(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], reset: torch.Tensor | None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        new_state: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, last_x, c = layer(x, state[2 * i], state[2 * i + 1], reset)
            new_state += [last_x.to(state[2 * i].dtype), c]
            if i < len(self.layers) - 1:
                x = self.drop(x)
        return x, tuple(new_state)
