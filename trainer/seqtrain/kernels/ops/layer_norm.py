"""LayerNorm over the last dimension (optional affine weight and bias), Triton forward and backward.

Forward, per row x of width n:
    mean = mean(x),   rstd = 1 / sqrt(mean((x - mean)^2) + eps),   x_hat = (x - mean) * rstd
    y = x_hat * w + b
Backward, with g = dy * w:
    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
    dw = sum over rows of dy * x_hat,   db = sum over rows of dy
Float32 arithmetic; `mean` and `rstd` are saved per row; dw/db are per-program partial rows summed
by torch (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from seqtrain.kernels import _alloc
from seqtrain.kernels.ops.utils import check_launchable, next_pow2, reduction_programs, row_warps, store_dtype


@triton.jit
def _layer_norm_fwd(X, W, B, Y, MEAN, RSTD, n_cols, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_bwd(DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, n_rows, n_cols, rows_per_prog,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    off = start.to(tl.int64) * n_cols + cols  # advanced per row: keeps 64-bit offsets in the loop
    for row in range(start, end):
        x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + off, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        if HAS_W:
            g = dy * w
        else:
            g = dy
        c1 = tl.sum(g * x_hat, axis=0) / n_cols
        c2 = tl.sum(g, axis=0) / n_cols
        tl.store(DX + off, ((g - c2 - x_hat * c1) * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
        off += n_cols
    if HAS_W:
        tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB_PART + pid * n_cols + cols, db, mask=mask)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        rows, n = x2.shape
        check_launchable(_layer_norm_fwd, x2)
        weight = weight.contiguous() if weight is not None else None
        bias = bias.contiguous() if bias is not None else None
        y = _alloc.empty(rows, n, dtype=store_dtype(x.dtype, x), device=x.device)
        mean = _alloc.empty(rows, dtype=torch.float32, device=x.device)
        rstd = _alloc.empty(rows, dtype=torch.float32, device=x.device)
        block = next_pow2(n)
        # Absent weight/bias: pass x as a dummy pointer; the constexpr flags keep it unread.
        _layer_norm_fwd[(rows,)](x2, weight if weight is not None else x2, bias if bias is not None else x2,
                                 y, mean, rstd, n, eps, HAS_W=weight is not None, HAS_B=bias is not None,
                                 BLOCK=block, num_warps=row_warps(block))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(x.dtype).view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        rows, n = x2.shape
        has_w, has_b = weight is not None, ctx.has_bias
        programs = reduction_programs(x2, rows)
        dx = _alloc.empty(rows, n, dtype=store_dtype(x2.dtype, x2), device=x2.device)
        dw_part = _alloc.empty(programs, n, dtype=torch.float32, device=x2.device) if has_w else x2
        db_part = _alloc.empty(programs, n, dtype=torch.float32, device=x2.device) if has_b else x2
        block = next_pow2(n)
        _layer_norm_bwd[(programs,)](dy.reshape(rows, n).contiguous(), x2, weight if has_w else x2, mean, rstd,
                                     dx, dw_part, db_part, rows, n, triton.cdiv(rows, programs),
                                     HAS_W=has_w, HAS_B=has_b, BLOCK=block, num_warps=row_warps(block))
        dw = dw_part.sum(0).to(weight.dtype) if has_w else None
        db = db_part.sum(0).to(ctx.bias_dtype) if has_b else None
        return dx.to(x2.dtype).view(dy.shape), dw, db, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    return LayerNormFunction.apply(x, weight, bias, eps)
