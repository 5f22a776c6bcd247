"""SwiGLU activation, Triton forward and backward (elementwise, float32 inside).

    y = silu(gate) * up = gate * sigmoid(gate) * up
    d_up   = dy * silu(gate)
    d_gate = dy * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))
Nothing but the inputs is saved; the backward recomputes the sigmoid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from seqtrain.kernels import _alloc
from seqtrain.kernels.ops.utils import check_launchable, store_dtype

_BLOCK = 1024


@triton.jit
def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        check_launchable(_swiglu_fwd, gate)
        out_dtype = torch.promote_types(gate.dtype, up.dtype)
        y = _alloc.empty_like(gate, dtype=store_dtype(out_dtype, gate))
        n = gate.numel()
        _swiglu_fwd[(triton.cdiv(n, _BLOCK),)](gate, up, y, n, BLOCK=_BLOCK)
        ctx.save_for_backward(gate, up)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        dg = _alloc.empty_like(gate, dtype=store_dtype(gate.dtype, gate))
        du = _alloc.empty_like(up, dtype=store_dtype(up.dtype, up))
        n = gate.numel()
        _swiglu_bwd[(triton.cdiv(n, _BLOCK),)](dy.contiguous(), gate, up, dg, du, n, BLOCK=_BLOCK)
        return dg.to(gate.dtype), du.to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up)
