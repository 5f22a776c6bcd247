"""Argument validation shared by the reference and the Triton paths.

Errors name the argument and say what shape or dtype is expected. Only metadata is inspected
(shapes, dtypes, devices), so validation never synchronizes with the GPU.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def floating(fn: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{fn}: {name} must be a floating-point tensor, got dtype {t.dtype}")


def same_shape(fn: str, **tensors: torch.Tensor) -> None:
    floating(fn, **tensors)
    (n0, t0), *rest = tensors.items()
    for name, t in rest:
        if t.shape != t0.shape:
            raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)} but {n0} has {tuple(t0.shape)}; they must match")


def norm_args(fn: str, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> None:
    floating(fn, x=x, weight=weight, bias=bias)
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least one dimension (the normalized one)")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (x.shape[-1],):
            raise ValueError(f"{fn}: {name} must have shape ({x.shape[-1]},) to match x's last dimension, "
                             f"got {tuple(p.shape)}")


def rope_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and return cos/sin broadcastable to x ([batch|1, 1, seq, head_dim])."""
    floating("rope", x=x, cos=cos, sin=sin)
    if x.dim() != 4:
        raise ValueError(f"rope: x must be [batch, heads, seq, head_dim], got shape {tuple(x.shape)}")
    b, _, s, d = x.shape
    if d % 2:
        raise ValueError(f"rope: head_dim must be even to rotate halves, got {d}")
    if cos.shape != sin.shape:
        raise ValueError(f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.dim() != 3 or cos.shape[1:] != (s, d) or cos.shape[0] not in (1, b):
        raise ValueError(f"rope: cos/sin must be [seq, head_dim] = [{s}, {d}] or [batch, seq, head_dim] = "
                         f"[{b}, {s}, {d}], got {tuple(cos.shape)}")
    return cos[:, None], sin[:, None]


def ce_args(fn: str, rows_shape: torch.Size, target: torch.Tensor) -> None:
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{fn}: target must be an integer tensor of class indices, got dtype {target.dtype}")
    if target.shape != rows_shape:
        raise ValueError(f"{fn}: target has shape {tuple(target.shape)} but the inputs have {tuple(rows_shape)} "
                         "rows; target must match every dimension except the last")


def linear_ce_args(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> None:
    floating("linear_cross_entropy", hidden=hidden, weight=weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight must be [vocab, hidden] = [V, {hidden.shape[-1]}] "
                         f"(like nn.Linear.weight), got {tuple(weight.shape)}")
    ce_args("linear_cross_entropy", hidden.shape[:-1], target)


def attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None) -> None:
    floating("attention", q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")
    if doc_ids is not None:
        if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
            raise TypeError(f"attention: doc_ids must be an integer tensor, got dtype {doc_ids.dtype}")
        if q.shape[2] != k.shape[2] or tuple(doc_ids.shape) != (q.shape[0], q.shape[2]):
            raise ValueError(f"attention: doc_ids must be [batch, seq] = [{q.shape[0]}, {q.shape[2]}] with "
                             f"seq_q == seq_k, got doc_ids {tuple(doc_ids.shape)} and seq_k {k.shape[2]}")


def scan_args(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None) -> None:
    same_shape("linear_scan", a=a, b=b)
    if a.dim() != 3:
        raise ValueError(f"linear_scan: a and b must be [batch, seq, dim], got shape {tuple(a.shape)}")
    if h0 is not None:
        floating("linear_scan", h0=h0)
        if tuple(h0.shape) != (a.shape[0], a.shape[2]):
            raise ValueError(f"linear_scan: h0 must be [batch, dim] = [{a.shape[0]}, {a.shape[2]}], "
                             f"got {tuple(h0.shape)}")
