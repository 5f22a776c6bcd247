"""Cross entropy with mean reduction over non-ignored targets, Triton forward and backward.

Per row x (one token's logits over V classes) with target t:
    lse  = log(sum_j exp(x_j))                   (online: running max and rescaled sum over V tiles)
    loss = lse - x_t,           0 when t == ignore_index
    L    = sum(loss) / n_valid,  n_valid = #rows with t != ignore_index   (NaN when 0, like PyTorch)
Backward:
    dL/dx_j = dL * (exp(x_j - lse) - [j == t]) / n_valid,   0 for ignored rows
The forward saves one float (lse) per row; the backward recomputes the softmax from the logits.
`ce_rows_with_grad_` is the fused variant used by linear_cross_entropy: it writes the gradient over
its input buffer in the same pass that computes the loss.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from seqtrain.kernels import _alloc
from seqtrain.kernels.ops.utils import check_launchable, next_pow2, store_dtype


@triton.jit
def _ce_fwd(X, stride_x, T, LOSS, LSE, G, stride_g, SCALE, n_cols, ignore_index,
            WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    t = tl.load(T + row).to(tl.int64)
    ignored = t == ignore_index
    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    x_t = tl.load(x_row + tl.where(ignored, 0, t)).to(tl.float32)
    tl.store(LOSS + row, tl.where(ignored, 0.0, lse - x_t))
    tl.store(LSE + row, lse)
    if WRITE_GRAD:
        # Second pass over the row: overwrite it (G may alias X) with the scaled gradient.
        scale = tl.where(ignored, 0.0, tl.load(SCALE).to(tl.float32))
        g_row = G + row * stride_g
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)) * scale
            tl.store(g_row + cols, g.to(G.dtype.element_ty), mask=mask)


@triton.jit
def _ce_bwd(X, T, LSE, G, SCALE, n_cols, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row).to(tl.int64)
    lse = tl.load(LSE + row)
    scale = tl.where(t == ignore_index, 0.0, tl.load(SCALE).to(tl.float32))
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)) * scale
        tl.store(G + row * n_cols + cols, g.to(G.dtype.element_ty), mask=mask)


def _block_v(n_cols: int, x: torch.Tensor) -> int:
    # GPU: tiles up to 8K columns keep registers busy without spilling; interpreter: bigger tiles
    # mean fewer Python-level steps.
    return min(next_pow2(n_cols), 8192 if x.is_cuda else 65536)


def ce_rows_with_grad_(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                       ignore_index: int) -> torch.Tensor:
    """Per-row losses of a 2-D `logits` view; overwrites `logits` with scale * dL/dlogits."""
    rows, n_cols = logits.shape
    check_launchable(_ce_fwd, logits)
    loss = _alloc.empty(rows, dtype=torch.float32, device=logits.device)
    lse = _alloc.empty(rows, dtype=torch.float32, device=logits.device)
    grad = logits if store_dtype(logits.dtype, logits) == logits.dtype else _alloc.empty(
        rows, n_cols, dtype=torch.float32, device=logits.device)
    _ce_fwd[(rows,)](logits, logits.stride(0), target, loss, lse, grad, grad.stride(0), scale, n_cols,
                     ignore_index, WRITE_GRAD=True, BLOCK_V=_block_v(n_cols, logits), num_warps=8)
    if grad is not logits:
        logits.copy_(grad)
    return loss


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        x = logits.reshape(-1, logits.shape[-1]).contiguous()
        t = target.reshape(-1).contiguous()
        rows, n_cols = x.shape
        check_launchable(_ce_fwd, x)
        loss = _alloc.empty(rows, dtype=torch.float32, device=x.device)
        lse = _alloc.empty(rows, dtype=torch.float32, device=x.device)
        _ce_fwd[(rows,)](x, n_cols, t, loss, lse, x, n_cols, lse, n_cols, ignore_index, WRITE_GRAD=False,
                         BLOCK_V=_block_v(n_cols, x), num_warps=8)
        n_valid = (t != ignore_index).sum()  # stays on the device: no sync
        ctx.save_for_backward(x, t, lse, n_valid)
        ctx.ignore_index = ignore_index
        ctx.shape = logits.shape
        return (loss.sum() / n_valid).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, t, lse, n_valid = ctx.saved_tensors
        rows, n_cols = x.shape
        scale = (grad_out.float() / n_valid).reshape(1)
        g = _alloc.empty_like(x, dtype=store_dtype(x.dtype, x))
        _ce_bwd[(rows,)](x, t, lse, g, scale, n_cols, ctx.ignore_index, BLOCK_V=_block_v(n_cols, x),
                         num_warps=8)
        return g.to(x.dtype).view(ctx.shape), None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return CrossEntropyFunction.apply(logits, target, ignore_index)
