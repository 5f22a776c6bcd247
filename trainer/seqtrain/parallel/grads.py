"""Gradient utilities for sharded layouts: the global norm (for clipping and metrics) and bucketed all-reduce.

The global norm must equal the single-process one: every distinct gradient element counted exactly once.
Each rank sums the squares of its local gradients with a weight of 1 / (number of ranks holding an identical
copy): replicated across tp -> 1/tp, replicated across dp (DDP) -> 1/dp, sharded (tp slices, FSDP2 DTensor
shards) -> 1. One SUM all-reduce over the world then gives the exact total (the weights are powers of two in
the tested layouts, so no rounding is added).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from seqtrain.runtime.dist import DistContext


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm(model: nn.Module, max_norm: float | None, ctx: DistContext, tp_names: set[str] = frozenset(),
                   skip_names: set[str] = frozenset()) -> torch.Tensor:
    """Global L2 norm of all gradients over the mesh (a float64 tensor on the device: no host sync), then scale
    them by min(1, max_norm / (norm + 1e-6)) like torch.nn.utils.clip_grad_norm_. `skip_names`: parameters
    whose gradient is a copy held elsewhere too (the last pipeline stage's tied embedding).

    The local shards' norms come from one `torch._foreach_norm` per (weight, device, dtype) group and the scaling
    from one `torch._foreach_mul_` per (device, dtype): a fixed number of fused kernels, not a float64 copy, a
    square and a sum per tensor (hundreds of launches and an fp64 copy of every gradient on a GPU)."""
    dev = ctx.device
    total = torch.zeros((), dtype=torch.float64, device=dev)
    groups: dict[tuple[float, torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    scale_groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = _local(p.grad)
        scale_groups[(g.device, g.dtype)].append(g)
        if name in skip_names:
            continue
        w = 1.0
        if name not in tp_names:
            w /= ctx.tp_size
        if not isinstance(p.grad, DTensor):
            w /= ctx.dp_size
        groups[(w, g.device, g.dtype)].append(g)  # .grad needs no detach: no autograd history
    for (w, _, _), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2.0)
        total += torch.stack(norms).to(device=dev, dtype=torch.float64).pow(2).sum() * w
    if ctx.distributed:
        dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm is not None and math.isfinite(max_norm):
        # on the device; a non-finite norm leaves the gradients alone (the engine skips that update)
        coef = torch.where(torch.isfinite(norm), (max_norm / (norm + 1e-6)).clamp(max=1.0), torch.ones_like(norm))
        for (device, dtype), tensors in scale_groups.items():
            torch._foreach_mul_(tensors, coef.to(device=device, dtype=dtype))
    return norm


def all_reduce_grads(params: Iterable[torch.Tensor], group, bucket_mb: int = 25, average_over: int = 1) -> None:
    """Sum gradients over `group` in flat buckets of about `bucket_mb` MiB (then divide by `average_over`)."""
    grads = [p.grad for p in params if p.grad is not None]
    limit = bucket_mb * 2**20
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        if average_over != 1:
            flat.div_(average_over)
        offset = 0
        for g in bucket:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
        bucket, size = [], 0

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= limit:
            flush()
    flush()
