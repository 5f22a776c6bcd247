"""`seqtrain.kernels`: fused GPU kernels with the same signature on every device.

Each function validates its arguments, then picks an implementation per call (see `backend_for`):
the Triton kernel (`seqtrain.kernels.ops.<op>`, imported on first use) when the tensor is on CUDA or
`TRITON_INTERPRET=1` is set, the PyTorch reference (`seqtrain.kernels.reference`) otherwise.
`SEQTRAIN_KERNELS=torch|triton` forces one. Importing this package never imports triton.

The models do not call this module directly: `seqtrain.models.dispatch` resolves `optimization.kernels` once per
run and sets a per-module flag (see docs/kernels.md). `select(enabled)` remains for callers that want the whole
namespace: this module (dispatching) when kernels are on, `reference` when they are off.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from seqtrain.kernels import _checks, reference
from seqtrain.kernels._alloc import poison_outputs
from seqtrain.kernels._runtime import Backend, backend_for

__all__ = [
    "Backend", "attention", "backend_for", "cross_entropy", "layer_norm", "linear_cross_entropy",
    "linear_scan", "poison_outputs", "reference", "rms_norm", "rope", "select", "swiglu",
]


def _op(name: str) -> ModuleType:
    return importlib.import_module(f"seqtrain.kernels.ops.{name}")


def _check_targets_on_cpu(target: torch.Tensor, vocab: int, ignore_index: int, fn: str) -> None:
    # A bad class index would make the kernel read out of bounds. Checking costs a device sync on
    # CUDA, so it is done only on CPU tensors (where PyTorch's own kernels also raise).
    if target.device.type == "cpu" and target.numel():
        bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
        if bool(bad.any()):
            value = int(target[bad][0])
            raise IndexError(f"{fn}: target contains {value}, outside [0, {vocab}) and not ignore_index "
                             f"({ignore_index})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight."""
    if backend_for(x) == "torch":
        return reference.rms_norm(x, weight, eps)
    _checks.norm_args("rms_norm", x, weight)
    return _op("rms_norm").rms_norm(x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dimension (like `F.layer_norm(x, x.shape[-1:], weight, bias, eps)`)."""
    if backend_for(x) == "torch":
        return reference.layer_norm(x, weight, bias, eps)
    _checks.norm_args("layer_norm", x, weight, bias)
    return _op("layer_norm").layer_norm(x, weight, bias, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise."""
    if backend_for(gate) == "torch":
        return reference.swiglu(gate, up)
    _checks.same_shape("swiglu", gate=gate, up=up)
    return _op("swiglu").swiglu(gate, up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half): x [batch, heads, seq, head_dim], cos/sin [(batch,) seq, head_dim]."""
    if backend_for(x) == "torch":
        return reference.rope(x, cos, sin)
    cos4, sin4 = _checks.rope_args(x, cos, sin)
    return _op("rope").rope(x, cos4[:, 0], sin4[:, 0])


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy over targets != ignore_index (F.cross_entropy, reduction="mean")."""
    if backend_for(logits) == "torch":
        return reference.cross_entropy(logits, target, ignore_index)
    _checks.ce_args("cross_entropy", logits.shape[:-1], target)
    _checks.floating("cross_entropy", logits=logits)
    _check_targets_on_cpu(target, logits.shape[-1], ignore_index, "cross_entropy")
    return _op("cross_entropy").cross_entropy(logits, target, ignore_index)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, target) without materializing the [tokens, vocab] logits.

    hidden [..., d], weight [vocab, d] (an `nn.Linear(d, vocab).weight`), target [...]. The Triton
    path works in chunks of `chunk_size` tokens (default: chunk logits about as large as `hidden`).
    The reference path is plain matmul + cross entropy.
    """
    if backend_for(hidden) == "torch":
        return reference.linear_cross_entropy(hidden, weight, target, ignore_index)
    _checks.linear_ce_args(hidden, weight, target)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive number of tokens, got {chunk_size}")
    _check_targets_on_cpu(target, weight.shape[0], ignore_index, "linear_cross_entropy")
    return _op("linear_cross_entropy").linear_cross_entropy(hidden, weight, target, ignore_index, chunk_size)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    doc_ids: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention, flash-style on the Triton path (no [seq, seq] matrix in memory).

    q [batch, heads, seq, head_dim]; k, v [batch, kv_heads, seq, head_dim] with heads % kv_heads == 0;
    doc_ids [batch, seq] ints: a token attends only to tokens with the same id (and, if causal, not
    later ones). scale defaults to 1/sqrt(head_dim).
    """
    if backend_for(q) == "torch":
        return reference.attention(q, k, v, causal, doc_ids, scale)
    _checks.attention_args(q, k, v, doc_ids)
    return _op("attention").attention(q, k, v, causal, doc_ids, scale)


def linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """All states of h_t = a_t * h_{t-1} + b_t along dim 1 of [batch, seq, dim]; h_{-1} = h0 or 0."""
    if backend_for(a) == "torch":
        return reference.linear_scan(a, b, h0)
    _checks.scan_args(a, b, h0)
    return _op("linear_scan").linear_scan(a, b, h0)


def select(enabled: bool | None) -> ModuleType:
    """The kernel namespace a model should call: this module when `enabled` (or None = automatic,
    i.e. Triton on CUDA), `reference` when False (e.g. `optimization.kernels: false`)."""
    import sys

    return reference if enabled is False else sys.modules[__name__]
