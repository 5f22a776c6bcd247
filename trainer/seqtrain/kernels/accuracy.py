"""Accuracy of each kernel against a float64 ground truth, shared by the tests and the benchmark.

For one op, shape and dtype: random float64 inputs are rounded to the dtype; the kernel (via the
public, dispatching function) and the PyTorch reference run in that dtype, the oracle runs in
float64 on the *rounded* inputs (so input rounding is not counted as error). Forward output and the
gradient of every differentiable input (for a random output gradient) are compared by the error
||x - x64|| / max(||x64||, SCALE_FLOOR * S), S the largest norm among the op's float64 output and
gradients: relative where the exact answer is of the op's size, and still defined, and not noise divided
by noise, where the exact answer is zero or nearly so (the gradient of a one-token softmax is exactly 0;
its computed value is rounding noise on the scale of the terms that cancel, not of the zero result).
The criterion of the issue: float32 within about 1e-5; in bfloat16 the kernel's error at most twice
the reference's error in bfloat16, both measured by this one rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import seqtrain.kernels as kernels
from seqtrain.kernels import reference

FP32_REL_TOL = 1e-5
LOW_PRECISION_FACTOR = 2.0
# Floor for "twice the reference error" when the reference happens to be exact (far below bf16 eps).
ERROR_FLOOR = 2.0**-20
# Errors of a tensor much smaller than the op's largest result are measured on a tenth of that size (see above).
SCALE_FLOOR = 0.1


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _targets(gen: torch.Generator, shape: tuple[int, ...], vocab: int, ignore_frac: float = 0.2) -> torch.Tensor:
    t = torch.randint(0, vocab, shape, generator=gen)
    t[torch.rand(shape, generator=gen) < ignore_frac] = -100
    t.view(-1)[0] = vocab - 1  # at least one counted target (all ignored gives NaN, tested separately)
    return t


def _doc_ids(gen: torch.Generator, batch: int, seq: int, mode: str | None) -> torch.Tensor | None:
    if mode is None:
        return None
    if mode == "random":  # ids scattered over the sequence (not contiguous)
        return torch.randint(0, 3, (batch, seq), generator=gen)
    # "packed": contiguous documents of random lengths, as a sequence packer produces
    cuts = torch.rand(batch, seq, generator=gen) < 4.0 / max(seq, 1)
    cuts[:, 0] = False
    return cuts.long().cumsum(1) + 7


def _rope_tables(gen: torch.Generator, batch: int, seq: int, dim: int, per_batch: bool) -> tuple[torch.Tensor, ...]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if per_batch:  # positions restart at random document starts
        starts = torch.rand(batch, seq, generator=gen) < 0.1
        pos = torch.arange(seq, dtype=torch.float64).expand(batch, seq)
        last_start = torch.where(starts, pos, torch.zeros_like(pos)).cummax(1).values
        pos = pos - last_start
    else:
        pos = torch.arange(seq, dtype=torch.float64)
    angles = pos[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def scan_loop(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """Sequential oracle for linear_scan: the recurrence exactly as written, one step at a time."""
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0
    out = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


@dataclass(frozen=True)
class OpSpec:
    """How to build inputs for one op; `make` returns (args, names of args, differentiable positions)."""

    make: Callable[..., tuple[list[Any], list[str], tuple[int, ...]]]
    oracle: Callable[..., torch.Tensor] | None = None
    defaults: dict[str, Any] = field(default_factory=dict)


def _make_rms_norm(gen, shape=(3, 37)):
    return [_randn(gen, *shape), 1 + _randn(gen, shape[-1], scale=0.1), 1e-6], ["x", "weight", "eps"], (0, 1)


def _make_layer_norm(gen, shape=(3, 37), affine=True, bias=True):
    w = 1 + _randn(gen, shape[-1], scale=0.1) if affine else None
    b = _randn(gen, shape[-1], scale=0.1) if bias else None
    x = _randn(gen, *shape, scale=2.0) + 0.5
    grads = tuple(i for i, t in enumerate((x, w, b)) if t is not None)
    return [x, w, b, 1e-5], ["x", "weight", "bias", "eps"], grads


def _make_swiglu(gen, shape=(3, 7, 33)):
    return [_randn(gen, *shape, scale=2.0), _randn(gen, *shape)], ["gate", "up"], (0, 1)


def _make_rope(gen, batch=2, heads=3, seq=19, dim=10, per_batch=False):
    cos, sin = _rope_tables(gen, batch, seq, dim, per_batch)
    return [_randn(gen, batch, heads, seq, dim), cos, sin], ["x", "cos", "sin"], (0,)


def _make_cross_entropy(gen, rows=(3, 11), vocab=53):
    logits = _randn(gen, *rows, vocab, scale=3.0)
    return [logits, _targets(gen, tuple(rows), vocab)], ["logits", "target"], (0,)


def _make_linear_cross_entropy(gen, rows=(3, 11), hidden=24, vocab=61, chunk_size=None):
    h = _randn(gen, *rows, hidden)
    w = _randn(gen, vocab, hidden, scale=1.0 / math.sqrt(hidden))
    return [h, w, _targets(gen, tuple(rows), vocab)], ["hidden", "weight", "target"], (0, 1)


def _make_attention(gen, batch=2, heads=4, kv_heads=2, seq=37, dim=24, causal=True, docs=None):
    q = _randn(gen, batch, heads, seq, dim)
    k = _randn(gen, batch, kv_heads, seq, dim)
    v = _randn(gen, batch, kv_heads, seq, dim)
    return [q, k, v, causal, _doc_ids(gen, batch, seq, docs)], ["q", "k", "v", "causal", "doc_ids"], (0, 1, 2)


def _make_linear_scan(gen, batch=2, seq=45, dim=13, h0=False):
    a = torch.sigmoid(_randn(gen, batch, seq, dim, scale=2.0))
    b = _randn(gen, batch, seq, dim)
    init = _randn(gen, batch, dim) if h0 else None
    grads = (0, 1, 2) if h0 else (0, 1)
    return [a, b, init], ["a", "b", "h0"], grads


OPS: dict[str, OpSpec] = {
    "rms_norm": OpSpec(_make_rms_norm),
    "layer_norm": OpSpec(_make_layer_norm),
    "swiglu": OpSpec(_make_swiglu),
    "rope": OpSpec(_make_rope),
    "cross_entropy": OpSpec(_make_cross_entropy),
    "linear_cross_entropy": OpSpec(_make_linear_cross_entropy),
    "attention": OpSpec(_make_attention),
    "linear_scan": OpSpec(_make_linear_scan, oracle=scan_loop),
}


def make_inputs(op: str, device: torch.device | str, seed: int = 0, **shape: Any):
    """float64 inputs for `op` on `device`: (args, arg names, differentiable positions)."""
    gen = torch.Generator().manual_seed(seed)
    args, names, grads = OPS[op].make(gen, **shape)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    return args, names, grads


def cast_args(args: list[Any], dtype: torch.dtype) -> list[Any]:
    return [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def run_with_grads(fn: Callable[..., torch.Tensor], args: list[Any], grad_pos: tuple[int, ...],
                   grad_out: torch.Tensor | float, **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward `fn(*args)` and the gradients of args[grad_pos] for the given output gradient."""
    args = [a.detach().clone().requires_grad_(i in grad_pos) if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)]
    out = fn(*args, **kwargs)
    gy = torch.full_like(out, grad_out) if isinstance(grad_out, float) else grad_out.to(out.dtype)
    wrt = [args[i] for i in grad_pos]
    # allow_unused: an input the output does not depend on (e.g. `a` when seq == 1) has zero gradient.
    grads = torch.autograd.grad(out, wrt, gy, allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g.detach() for g, x in zip(grads, wrt, strict=True)]


def rel_err(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||x - ref|| / max(||ref||, floor) in float64 (NaN if x has NaN, e.g. an unwritten poisoned element); the
    plain difference when both are 0."""
    diff = (x.double() - ref).norm()
    scale = max(float(ref.norm()), floor)
    return float(diff) / scale if scale > 0 else float(diff)


def measure(op: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
            **shape: Any) -> dict[str, Any]:
    """Relative errors of kernel and reference vs the float64 oracle, per output and gradient."""
    spec = OPS[op]
    kwargs = {}
    if op == "linear_cross_entropy" and shape.get("chunk_size"):
        kwargs["chunk_size"] = shape["chunk_size"]
    args64, names, grad_pos = make_inputs(op, device, seed, **shape)
    low = cast_args(args64, dtype)
    exact = cast_args(low, torch.float64)  # the oracle sees the same rounded inputs
    oracle = spec.oracle or getattr(reference, op)
    with torch.no_grad():
        out_shape = oracle(*exact).shape
    gen = torch.Generator().manual_seed(seed + 1)
    # A scalar output (the losses) gets 0.75, not 1, so a missing grad_output scaling shows.
    grad_out = 0.75 if not out_shape else torch.randn(out_shape, generator=gen, dtype=torch.float64).to(device)
    out64, grads64 = run_with_grads(oracle, exact, grad_pos, grad_out)
    floor = SCALE_FLOOR * max(float(t.norm()) for t in (out64, *grads64))
    result: dict[str, Any] = {"op": op, "dtype": str(dtype).replace("torch.", ""), "shape": shape,
                              "backend": kernels.backend_for(low[0])}
    for label, fn, kw in (("kernel", getattr(kernels, op), kwargs), ("reference", getattr(reference, op), {})):
        out, grads = run_with_grads(fn, low, grad_pos, grad_out, **kw)
        errs = {"out": rel_err(out, out64, floor)}
        errs.update({f"d_{names[i]}": rel_err(g, g64, floor)
                     for i, g, g64 in zip(grad_pos, grads, grads64, strict=True)})
        result[label] = errs
    return result


def violations(result: dict[str, Any]) -> list[str]:
    """Which outputs/gradients of a `measure()` result break the accuracy criterion (empty = pass)."""
    bad = []
    for name, err in result["kernel"].items():
        ref_err = result["reference"][name]
        if result["dtype"] in ("float32", "float64"):
            limit = FP32_REL_TOL
        else:
            limit = max(LOW_PRECISION_FACTOR * ref_err, ERROR_FLOOR)
        if not err <= limit:  # also catches NaN
            bad.append(f"{result['op']} {result['dtype']} {name}: kernel error {err:.3g} > limit {limit:.3g} "
                       f"(reference error {ref_err:.3g})")
    return bad
