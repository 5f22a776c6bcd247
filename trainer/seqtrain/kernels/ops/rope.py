"""Rotary position embedding (rotate-half convention), Triton forward and backward.

With x = [x1, x2] split into halves of the head dimension and cos = [c1, c2], sin = [s1, s2]:
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2            (i.e. y = x * cos + rotate_half(x) * sin)
The map is linear in x, so the backward applies its transpose:
    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1
cos/sin are [seq, head_dim] or [batch, seq, head_dim] and are treated as constants (no gradient).
One program handles a tile of BLOCK_S positions of one (batch, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from seqtrain.kernels import _alloc
from seqtrain.kernels.ops.utils import check_launchable, next_pow2, store_dtype


@triton.jit
def _rope_kernel(X, COS, SIN, Y, heads, seq, half, cs_batch_stride, BACKWARD: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)
    b = bh // heads
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    j = tl.arange(0, BLOCK_H)
    mask = (s[:, None] < seq) & (j[None, :] < half)
    d = 2 * half
    x_off = bh * seq * d + s[:, None] * d + j[None, :]
    cs_off = b * cs_batch_stride + s[:, None] * d + j[None, :]
    x1 = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_off + half, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + cs_off, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs_off + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs_off, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs_off + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + x_off, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + x_off + half, y2.to(Y.dtype.element_ty), mask=mask)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    batch, heads, seq, d = x.shape
    check_launchable(_rope_kernel, x)
    y = _alloc.empty_like(x, dtype=store_dtype(x.dtype, x))
    block_s = min(64, next_pow2(seq))
    grid = (triton.cdiv(seq, block_s), batch * heads)
    batch_stride = 0 if cos.shape[0] == 1 else seq * d
    _rope_kernel[grid](x, cos, sin, y, heads, seq, d // 2, batch_stride, BACKWARD=backward,
                       BLOCK_S=block_s, BLOCK_H=next_pow2(d // 2))
    return y.to(x.dtype)


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # cos/sin arrive as [1|batch, seq, head_dim].
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _apply(x.contiguous(), cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _apply(dy.contiguous(), cos, sin, backward=True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, head_dim]; cos/sin [1|batch, seq, head_dim] (already validated)."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rope: the Triton kernel treats cos/sin as constants; pass cos.detach() and "
                         "sin.detach(), or use seqtrain.kernels.reference.rope to differentiate them")
    return RoPEFunction.apply(x, cos, sin)
