"""Flash-style attention (tiled, online softmax), causal and/or packed documents, forward and backward.

q [B, H, Sq, D], k/v [B, Hk, Sk, D] with H % Hk == 0 (grouped-query), scale c = 1/sqrt(D) by default.
Query i may attend key j iff (not causal or j <= i) and (no doc_ids or doc[i] == doc[j]).
Forward, per query tile, over key tiles (the [Sq, Sk] matrix is never stored):
    s = c * q k^T (masked to -inf),  m' = max(m, rowmax s),  l' = l e^(m-m') + rowsum e^(s-m')
    acc' = acc e^(m-m') + e^(s-m') v,   o = acc / l,   lse = m + log l   (saved, one float per row)
Backward (FlashAttention-2), with delta_i = sum_d o_id do_id and p = exp(s - lse):
    dv = p^T do,   dp = do v^T,   ds = p (dp - delta),   dq = c ds k,   dk = c ds^T q
computed by two kernels: one per key tile (dk, dv; loops over query tiles), one per query tile
(dq; loops over key tiles), so no atomics. Exponentials use base 2 (lse is stored in log2 units).

Packed documents: tiles that cannot contain an allowed pair are skipped. For every position the first
and last occurrence of its document id bound the keys (or queries) it can see, so a query tile only
visits key tiles in [min first, max last] of its queries: cost grows with sum(doc_len^2), not seq^2.
The doc ids need not be contiguous; the bounds stay valid (only less tight) when they are not.

Tiles: the tile the document ranges are keyed by is fixed per launch (the query tile of the forward and dq
kernels, the key tile of dk/dv: 128 rows for head_dim <= 64, else 64), and on CUDA `triton.autotune` picks the
other tile, num_warps and num_stages per shape (`autotune_configs`). Triton's CPU interpreter runs one fixed
pair (`INTERPRET_TILES`), small enough to be quick there.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from seqtrain.kernels import _alloc
from seqtrain.kernels.ops.utils import TL_DTYPE, check_launchable, next_pow2, on_cpu, store_dtype

_LOG2E = 1.4426950408889634


@triton.jit
def _tile_mask(offs_m, offs_n, s_q, s_k, doc_q, DOC, b, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr):
    valid = (offs_m[:, None] < s_q) & (offs_n[None, :] < s_k)
    if CAUSAL:
        valid = valid & (offs_m[:, None] >= offs_n[None, :])
    if HAS_DOC:
        doc_k = tl.load(DOC + b * s_k + offs_n, mask=offs_n < s_k, other=-1)
        valid = valid & (doc_q[:, None] == doc_k[None, :])
    return valid


@triton.jit
def _attn_fwd(Q, K, V, OUT, LSE, DOC, KV_RANGE, scale_log2,
              heads, group, s_q, s_k, head_dim, n_m_blocks,
              CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // heads
    bhk = b * (heads // group) + (bh % heads) // group
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q_ptrs = Q + bh * s_q * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < s_q) & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    k_base = K + bhk * s_k * head_dim
    v_base = V + bhk * s_k * head_dim
    doc_q = tl.zeros([BLOCK_M], dtype=tl.int64)
    lo = 0
    hi = s_k
    if HAS_DOC:
        doc_q = tl.load(DOC + b * s_q + offs_m, mask=offs_m < s_q, other=-2).to(tl.int64)
        lo = tl.load(KV_RANGE + (b * n_m_blocks + start_m) * 2)
        hi = tl.load(KV_RANGE + (b * n_m_blocks + start_m) * 2 + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, (start_m + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < s_k
        kt = tl.load(k_base + offs_n[None, :] * head_dim + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                     other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
        valid = _tile_mask(offs_m, offs_n, s_q, s_k, doc_q, DOC, b, CAUSAL, HAS_DOC)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None] * head_dim + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(OUT + bh * s_q * head_dim + offs_m[:, None] * head_dim + offs_d[None, :], o.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < s_q) & d_ok[None, :])
    tl.store(LSE + bh * s_q + offs_m, m_i + tl.log2(l_safe), mask=offs_m < s_q)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, DOC, Q_RANGE, scale_log2, scale,
                   heads, group, s_q, s_k, head_dim, n_n_blocks,
                   CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    start_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // heads
    bhk = b * (heads // group) + (bh % heads) // group
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    kv_mask = (offs_n[:, None] < s_k) & d_ok[None, :]
    kv_off = bhk * s_k * head_dim + offs_n[:, None] * head_dim + offs_d[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    q_base = Q + bh * s_q * head_dim
    do_base = DO + bh * s_q * head_dim
    lo = 0
    hi = s_q
    if HAS_DOC:
        lo = tl.load(Q_RANGE + (b * n_n_blocks + start_n) * 2)
        hi = tl.load(Q_RANGE + (b * n_n_blocks + start_n) * 2 + 1)
    if CAUSAL:
        lo = tl.maximum(lo, start_n * BLOCK_N)
    lo = (lo // BLOCK_M) * BLOCK_M
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < s_q
        q_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + offs_m[:, None] * head_dim + offs_d[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)
        do = tl.load(do_base + offs_m[:, None] * head_dim + offs_d[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)
        lse = tl.load(LSE + bh * s_q + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(DELTA + bh * s_q + offs_m, mask=m_ok, other=0.0)
        doc_q = tl.zeros([BLOCK_M], dtype=tl.int64)
        if HAS_DOC:
            doc_q = tl.load(DOC + b * s_q + offs_m, mask=m_ok, other=-2).to(tl.int64)
        valid = _tile_mask(offs_m, offs_n, s_q, s_k, doc_q, DOC, b, CAUSAL, HAS_DOC)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p.to(DOT_DTYPE)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(DOT_DTYPE)), q, input_precision=PRECISION)
    out_off = bh * s_k * head_dim + offs_n[:, None] * head_dim + offs_d[None, :]
    tl.store(DK + out_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, DOC, KV_RANGE, scale_log2, scale,
                 heads, group, s_q, s_k, head_dim, n_m_blocks,
                 CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // heads
    bhk = b * (heads // group) + (bh % heads) // group
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    m_ok = offs_m < s_q
    q_mask = m_ok[:, None] & d_ok[None, :]
    q_off = bh * s_q * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]
    q = tl.load(Q + q_off, mask=q_mask, other=0.0).to(DOT_DTYPE)
    do = tl.load(DO + q_off, mask=q_mask, other=0.0).to(DOT_DTYPE)
    lse = tl.load(LSE + bh * s_q + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + bh * s_q + offs_m, mask=m_ok, other=0.0)
    k_base = K + bhk * s_k * head_dim
    v_base = V + bhk * s_k * head_dim
    doc_q = tl.zeros([BLOCK_M], dtype=tl.int64)
    lo = 0
    hi = s_k
    if HAS_DOC:
        doc_q = tl.load(DOC + b * s_q + offs_m, mask=m_ok, other=-2).to(tl.int64)
        lo = tl.load(KV_RANGE + (b * n_m_blocks + start_m) * 2)
        hi = tl.load(KV_RANGE + (b * n_m_blocks + start_m) * 2 + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, (start_m + 1) * BLOCK_M)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < s_k
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * head_dim + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(v_base + offs_n[:, None] * head_dim + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        valid = _tile_mask(offs_m, offs_n, s_q, s_k, doc_q, DOC, b, CAUSAL, HAS_DOC)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(DOT_DTYPE), k, input_precision=PRECISION)
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def doc_ranges(doc_ids: torch.Tensor, block: int) -> torch.Tensor:
    """[B, n_blocks, 2] int32: for each tile of `block` positions, the half-open range of positions
    that share a document id with some position of the tile (first occurrence .. last occurrence).

    Sort-based, fixed-size ops only (no host sync): after a stable sort, equal ids form runs whose
    first/last elements carry the first/last original index of that id.
    """
    bsz, seq = doc_ids.shape
    vals, idx = torch.sort(doc_ids, dim=1, stable=True)
    pos = torch.arange(seq, device=doc_ids.device).expand(bsz, seq)
    change = torch.ones_like(vals, dtype=torch.bool)
    change[:, 1:] = vals[:, 1:] != vals[:, :-1]
    run_start = torch.where(change, pos, 0).cummax(dim=1).values
    is_end = torch.ones_like(change)
    is_end[:, :-1] = change[:, 1:]
    run_end = torch.where(is_end, pos, seq).flip(1).cummin(dim=1).values.flip(1)
    first = torch.empty_like(idx).scatter_(1, idx, idx.gather(1, run_start))
    last = torch.empty_like(idx).scatter_(1, idx, idx.gather(1, run_end))
    n_blocks = triton.cdiv(seq, block)
    pad = n_blocks * block - seq
    first = torch.nn.functional.pad(first, (0, pad), value=seq).view(bsz, n_blocks, block).amin(-1)
    last = torch.nn.functional.pad(last, (0, pad), value=-1).view(bsz, n_blocks, block).amax(-1)
    return torch.stack((first, last + 1), dim=-1).to(torch.int32).contiguous()


# (fixed tile, free tile) under Triton's interpreter; tests set rectangular pairs like the CUDA configs'.
INTERPRET_TILES = (16, 16)
_AUTOTUNE_KEY = ["s_q", "s_k", "head_dim", "group", "CAUSAL", "HAS_DOC"]


def autotune_configs(free: str) -> list[triton.Config]:
    """CUDA configs for the free tile `free` ("BLOCK_N" of forward and dq, "BLOCK_M" of dk/dv). Six, not a
    grid: each is compiled per (dtype, head_dim, causal, documents), and a lease has minutes, not hours."""
    return [triton.Config({free: n}, num_warps=w, num_stages=st)
            for n in (32, 64, 128) for w, st in ((4, 2), (8, 3))]


@functools.lru_cache(maxsize=1)
def _tuned() -> dict[str, object]:
    """The autotuned CUDA launchers, built on first CUDA use (the interpreter never sees them). Each kernel only
    writes its outputs, so the autotuner's repeated launches need no reset."""
    def tune(kernel: object, free: str) -> object:
        # cache_results: the choice is kept in Triton's cache folder, so a later process skips the tuning runs
        return triton.autotune(autotune_configs(free), key=_AUTOTUNE_KEY, cache_results=True)(kernel)

    return {"fwd": tune(_attn_fwd, "BLOCK_N"), "dkdv": tune(_attn_bwd_dkdv, "BLOCK_M"),
            "dq": tune(_attn_bwd_dq, "BLOCK_N")}


def _config(q: torch.Tensor) -> dict:
    cpu = on_cpu(q)
    block_d = max(16, next_pow2(q.shape[-1]))
    # bf16 tl.dot is wrong in Triton 3.9's interpreter (numpy has no bfloat16): upcast on the CPU.
    dot_dtype = tl.float32 if cpu else TL_DTYPE[q.dtype]
    # fp32/fp64 inputs: IEEE products (TF32 would cost ~1e-3 relative accuracy); ignored for 16-bit.
    precision = "tf32" if q.dtype in (torch.float16, torch.bfloat16) else "ieee"
    tile = INTERPRET_TILES[0] if cpu else (128 if block_d <= 64 else 64)
    return dict(tile=tile, BLOCK_D=block_d, DOT_DTYPE=dot_dtype, PRECISION=precision)


def _launcher(kind: str, q: torch.Tensor, cfg: dict) -> tuple[object, dict]:
    """(kernel, its tile kwargs): the fixed tile by name, plus the free tile under the interpreter (on CUDA
    the autotuner supplies it with num_warps and num_stages)."""
    fixed, free = ("BLOCK_N", "BLOCK_M") if kind == "dkdv" else ("BLOCK_M", "BLOCK_N")
    consts = {k: v for k, v in cfg.items() if k != "tile"}
    consts[fixed] = cfg["tile"]
    if on_cpu(q):
        consts[free] = INTERPRET_TILES[1]
        return {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}[kind], consts
    return _tuned()[kind], consts


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                doc_ids: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        check_launchable(_attn_fwd, q)
        bsz, heads, s_q, d = q.shape
        s_k = k.shape[2]
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        cfg = _config(q)
        n_m = triton.cdiv(s_q, cfg["tile"])
        has_doc = doc_ids is not None
        doc = doc_ids.contiguous() if has_doc else q
        kv_range = doc_ranges(doc_ids, cfg["tile"]) if has_doc else q
        o = _alloc.empty_like(q, dtype=store_dtype(q.dtype, q))
        lse = _alloc.empty(bsz, heads, s_q, dtype=torch.float32, device=q.device)
        fwd, consts = _launcher("fwd", q, cfg)
        fwd[(n_m, bsz * heads)](q, k, v, o, lse, doc, kv_range, scale * _LOG2E, heads, heads // k.shape[1],
                                s_q, s_k, d, n_m, CAUSAL=causal, HAS_DOC=has_doc, **consts)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse, doc_ids)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse, doc_ids = ctx.saved_tensors
        do = do.contiguous()
        bsz, heads, s_q, d = q.shape
        kv_heads, s_k = k.shape[1], k.shape[2]
        group = heads // kv_heads
        cfg = _config(q)
        has_doc = doc_ids is not None
        doc = doc_ids.contiguous() if has_doc else q
        delta = (o.float() * do.float()).sum(-1)  # [B, H, Sq]
        # Per query head; grouped heads are summed afterwards, in float32.
        grad_dtype = store_dtype(q.dtype, q) if group == 1 else torch.float32
        dk = _alloc.empty(bsz, heads, s_k, d, dtype=grad_dtype, device=q.device)
        dv = _alloc.empty(bsz, heads, s_k, d, dtype=grad_dtype, device=q.device)
        dq = _alloc.empty_like(q, dtype=store_dtype(q.dtype, q))
        tile = cfg["tile"]
        n_n = triton.cdiv(s_k, tile)
        n_m = triton.cdiv(s_q, tile)
        q_range = doc_ranges(doc_ids, tile) if has_doc else q
        kv_range = q_range
        scale_log2 = ctx.scale * _LOG2E
        dkdv, dkdv_consts = _launcher("dkdv", q, cfg)
        dq_kernel, dq_consts = _launcher("dq", q, cfg)
        dkdv[(n_n, bsz * heads)](q, k, v, do, lse, delta, dk, dv, doc, q_range, scale_log2, ctx.scale,
                                 heads, group, s_q, s_k, d, n_n, CAUSAL=ctx.causal, HAS_DOC=has_doc, **dkdv_consts)
        dq_kernel[(n_m, bsz * heads)](q, k, v, do, lse, delta, dq, doc, kv_range, scale_log2, ctx.scale,
                                      heads, group, s_q, s_k, d, n_m, CAUSAL=ctx.causal, HAS_DOC=has_doc,
                                      **dq_consts)
        if group > 1:
            dk = dk.view(bsz, kv_heads, group, s_k, d).sum(2)
            dv = dv.view(bsz, kv_heads, group, s_k, d).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              doc_ids: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    return AttentionFunction.apply(q, k, v, causal, doc_ids, scale)
