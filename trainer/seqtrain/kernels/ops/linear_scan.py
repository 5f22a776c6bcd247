"""Linear recurrence h_t = a_t * h_{t-1} + b_t as a parallel scan, Triton forward and backward.

Shapes [batch, seq, dim]; h_{-1} = h0 (or 0). The affine maps x -> a x + b compose associatively:
    (a1, b1) then (a2, b2)  =  (a1 a2, a2 b1 + b2)
so each program scans a [BLOCK_T, BLOCK_D] tile along time with `tl.associative_scan` (log-depth,
no loop over steps inside the tile) and carries the last state into the next tile.
Backward, with incoming gradient g_t = dL/dh_t, the adjoint runs the same recurrence in reverse:
    d_t = g_t + a_{t+1} d_{t+1}   (d_{seq-1} = g_{seq-1})
    db_t = d_t,   da_t = d_t h_{t-1},   dh0 = a_0 d_0
which the backward kernel computes with the same forward scan on time-reversed tiles.
Used for QRNN fo-pooling (a = f, b = (1 - f) z) and minGRU (a = 1 - z, b = z h~).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from seqtrain.kernels import _alloc
from seqtrain.kernels.ops.utils import check_launchable, next_pow2, store_dtype


@triton.jit
def _compose(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _scan_fwd(A, B, H0, H, seq, dim, HAS_H0: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_b = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    if HAS_H0:
        carry = tl.load(H0 + pid_b * dim + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = pid_b * seq * dim
    for start in range(0, seq, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask = (offs_t[:, None] < seq) & d_ok[None, :]
        off = base + offs_t[:, None] * dim + offs_d[None, :]
        a = tl.load(A + off, mask=mask, other=1.0).to(tl.float32)
        b = tl.load(B + off, mask=mask, other=0.0).to(tl.float32)
        a_cum, h_local = tl.associative_scan((a, b), 0, _compose)
        h = h_local + a_cum * carry[None, :]
        tl.store(H + off, h.to(H.dtype.element_ty), mask=mask)
        # Last valid row of the tile becomes the carry (padded rows are identity maps: a=1, b=0).
        carry = tl.sum(tl.where(offs_t[:, None] == tl.minimum(start + BLOCK_T, seq) - 1, h, 0.0), axis=0)


@triton.jit
def _scan_bwd(A, H, H0, G, DA, DB, DH0, seq, dim, HAS_H0: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_D: tl.constexpr):
    pid_b = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    base = pid_b * seq * dim
    carry = tl.zeros([BLOCK_D], dtype=tl.float32)  # d_{t+1} for the first (latest) row of the tile
    n_tiles = tl.cdiv(seq, BLOCK_T)
    d0 = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, n_tiles):
        # Tile rows in reverse time order: row r holds time t = end - r.
        end = seq - 1 - i * BLOCK_T
        offs_t = end - tl.arange(0, BLOCK_T)
        t_ok = offs_t >= 0
        mask = t_ok[:, None] & d_ok[None, :]
        off = base + offs_t[:, None] * dim + offs_d[None, :]
        g = tl.load(G + off, mask=mask, other=0.0).to(tl.float32)
        a_next = tl.load(A + off + dim, mask=mask & (offs_t[:, None] + 1 < seq), other=0.0).to(tl.float32)
        # d_t = g_t + a_{t+1} d_{t+1}: a forward scan over reversed time with coefficients a_{t+1}.
        p_cum, d_local = tl.associative_scan((a_next, g), 0, _compose)
        d = d_local + p_cum * carry[None, :]
        h_prev = tl.load(H + off - dim, mask=mask & (offs_t[:, None] >= 1), other=0.0).to(tl.float32)
        if HAS_H0:
            h0 = tl.load(H0 + pid_b * dim + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            h_prev = tl.where(offs_t[:, None] == 0, h0[None, :], h_prev)
        tl.store(DB + off, d.to(DB.dtype.element_ty), mask=mask)
        tl.store(DA + off, (d * h_prev).to(DA.dtype.element_ty), mask=mask)
        last_row = tl.minimum(end, BLOCK_T - 1)  # row of the earliest valid time in this tile
        carry = tl.sum(tl.where(tl.arange(0, BLOCK_T)[:, None] == last_row, d, 0.0), axis=0)
        d0 = carry  # after the final tile this is d_0
    if HAS_H0:
        a0 = tl.load(A + base + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        tl.store(DH0 + pid_b * dim + offs_d, (a0 * d0).to(DH0.dtype.element_ty), mask=d_ok)


def _blocks(x: torch.Tensor, seq: int, dim: int) -> tuple[int, int]:
    if x.is_cuda:
        return min(next_pow2(seq), 256), min(next_pow2(dim), 32)
    # The interpreter runs a generic associative_scan element by element in Python: small tiles
    # keep the padding (and so the time) down.
    return min(next_pow2(seq), 32), min(next_pow2(dim), 16)


class LinearScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None) -> torch.Tensor:
        a, b = a.contiguous(), b.contiguous()
        h0c = h0.contiguous() if h0 is not None else None
        check_launchable(_scan_fwd, a)
        bsz, seq, dim = a.shape
        out_dtype = torch.promote_types(a.dtype, b.dtype)
        h = _alloc.empty(bsz, seq, dim, dtype=store_dtype(out_dtype, a), device=a.device)
        block_t, block_d = _blocks(a, seq, dim)
        grid = (bsz, triton.cdiv(dim, block_d))
        _scan_fwd[grid](a, b, h0c if h0c is not None else a, h, seq, dim, HAS_H0=h0c is not None,
                        BLOCK_T=block_t, BLOCK_D=block_d)
        h = h.to(out_dtype)
        ctx.save_for_backward(a, h, h0c)
        ctx.b_dtype = b.dtype
        return h

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, h, h0 = ctx.saved_tensors
        bsz, seq, dim = a.shape
        da = _alloc.empty_like(a, dtype=store_dtype(a.dtype, a))
        db = _alloc.empty(bsz, seq, dim, dtype=store_dtype(ctx.b_dtype, a), device=a.device)
        dh0 = _alloc.empty_like(h0, dtype=store_dtype(h0.dtype, a)) if h0 is not None else None
        block_t, block_d = _blocks(a, seq, dim)
        grid = (bsz, triton.cdiv(dim, block_d))
        _scan_bwd[grid](a, h, h0 if h0 is not None else a, g.contiguous(), da, db,
                        dh0 if dh0 is not None else a, seq, dim, HAS_H0=h0 is not None,
                        BLOCK_T=block_t, BLOCK_D=block_d)
        return da.to(a.dtype), db.to(ctx.b_dtype), dh0.to(h0.dtype) if h0 is not None else None


def linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    return LinearScanFunction.apply(a, b, h0)
