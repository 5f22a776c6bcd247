"""RMSNorm over the last dimension, Triton forward and backward.

Forward, per row x of width n:
    rstd = 1 / sqrt(mean(x^2) + eps),   x_hat = x * rstd,   y = x_hat * w
Backward, with g = dy * w:
    dx = rstd * (g - x_hat * mean(g * x_hat))
    dw = sum over rows of dy * x_hat
All arithmetic is in float32; y and dx are rounded once to x.dtype, dw to w.dtype. `rstd` (one
float per row) is the only saved statistic. dw is reduced as one partial row per program, summed by
torch afterwards (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from seqtrain.kernels import _alloc
from seqtrain.kernels.ops.utils import check_launchable, next_pow2, reduction_programs, row_warps, store_dtype


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(Y + row * n_cols + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, DW_PART, n_rows, n_cols, rows_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    off = start.to(tl.int64) * n_cols + cols  # advanced per row: keeps 64-bit offsets in the loop
    for row in range(start, end):
        x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        g = dy * w
        c = tl.sum(g * x_hat, axis=0) / n_cols
        tl.store(DX + off, ((g - x_hat * c) * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        off += n_cols
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)


def rms_norm_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x2.shape
    check_launchable(_rms_norm_fwd, x2)
    y = _alloc.empty(rows, n, dtype=store_dtype(x2.dtype, x2), device=x2.device)
    rstd = _alloc.empty(rows, dtype=torch.float32, device=x2.device)
    block = next_pow2(n)
    _rms_norm_fwd[(rows,)](x2, weight, y, rstd, n, eps, BLOCK=block, num_warps=row_warps(block))
    return y.to(x2.dtype), rstd


def rms_norm_backward(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x2.shape
    programs = reduction_programs(x2, rows)
    rows_per_prog = triton.cdiv(rows, programs)
    dx = _alloc.empty(rows, n, dtype=store_dtype(x2.dtype, x2), device=x2.device)
    dw_part = _alloc.empty(programs, n, dtype=torch.float32, device=x2.device)
    block = next_pow2(n)
    _rms_norm_bwd[(programs,)](dy2, x2, weight, rstd, dx, dw_part, rows, n, rows_per_prog, BLOCK=block,
                               num_warps=row_warps(block))
    return dx.to(x2.dtype), dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        weight = weight.contiguous()
        y, rstd = rms_norm_forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy.reshape(x2.shape).contiguous(), x2, weight, rstd)
        return dx.view(dy.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)
