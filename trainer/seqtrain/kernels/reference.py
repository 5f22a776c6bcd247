"""Pure-PyTorch reference implementations of every `seqtrain.kernels` function.

These are the ground truth the Triton kernels are tested against (in float64) and the path used on
machines without Triton. They run in the input dtype, differentiate through ordinary autograd and
import nothing beyond torch. Models that must not use custom kernels call these directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seqtrain.kernels import _checks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in float32, returned in x.dtype."""
    _checks.norm_args("rms_norm", x, weight)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """`F.layer_norm` over the last dimension."""
    _checks.norm_args("layer_norm", x, weight, bias)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    _checks.same_shape("swiglu", gate=gate, up=up)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention: y = x * cos + rotate_half(x) * sin.

    x is [batch, heads, seq, head_dim]; cos/sin are [seq, head_dim] or [batch, seq, head_dim]
    (per-sequence positions, e.g. restarting at each packed document).
    """
    cos, sin = _checks.rope_args(x, cos, sin)
    return x * cos + rotate_half(x) * sin


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy over targets != ignore_index; logits [..., vocab], target [...]."""
    _checks.ce_args("cross_entropy", logits.shape[:-1], target)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, target); materializes the full [tokens, vocab] logits."""
    _checks.linear_ce_args(hidden, weight, target)
    return cross_entropy(hidden @ weight.t(), target, ignore_index)


def attention_mask(
    doc_ids: torch.Tensor | None, causal: bool, s_q: int, s_k: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean mask (True = may attend) equivalent to `causal` and `doc_ids`: [batch|1, 1, s_q, s_k].

    Causal is top-left aligned (query i sees keys j <= i), like SDPA's `is_causal`.
    """
    mask = None
    if causal:
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril()[None, None]
    if doc_ids is not None:
        same = (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """`scaled_dot_product_attention` with the boolean mask for `causal` and `doc_ids`.

    q is [batch, heads, seq_q, head_dim]; k, v are [batch, kv_heads, seq_k, head_dim] with
    heads % kv_heads == 0 (grouped-query attention); doc_ids is [batch, seq] of ints.
    Builds the [seq, seq] mask, so memory grows with seq^2.
    """
    _checks.attention_args(q, k, v, doc_ids)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    mask = attention_mask(doc_ids, causal, q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """All states of h_t = a_t * h_{t-1} + b_t along dim 1 of [batch, seq, dim]; h_{-1} = h0 or 0.

    A Hillis-Steele parallel scan: log2(seq) vectorized steps that compose the affine maps
    (a, b) pairwise, not a Python loop over time steps. O(seq log seq) work, exact (products and
    sums only, no division or logarithm), differentiable by autograd.
    """
    _checks.scan_args(a, b, h0)
    if h0 is not None:
        # Fold h0 into the first step: h_0 = a_0 * h0 + b_0.
        b = torch.cat((b[:, :1] + a[:, :1] * h0.unsqueeze(1), b[:, 1:]), dim=1)
    seq = a.shape[1]
    shift = 1
    while shift < seq:
        # After this step, (a_t, b_t) is the composition of the maps t-2*shift+1 .. t.
        b = torch.cat((b[:, :shift], b[:, shift:] + a[:, shift:] * b[:, :-shift]), dim=1)
        a = torch.cat((a[:, :shift], a[:, shift:] * a[:, :-shift]), dim=1)
        shift *= 2
    return b
