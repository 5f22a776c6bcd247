"""The optimizer step inside backward for FSDP2: each unit's shard is updated as soon as its gradient is
reduce-scattered, and that gradient freed, so a rank never holds its whole gradient shard (a quarter of the
model on 4 ranks) on top of its parameter shard (the fused update of LOMO, Lv et al. 2023).

Only where it is exactly the step after backward (`blocker` says why not): SGD updates each parameter from its own
gradient alone, with the schedule's current lr; no gradient clipping (the clip factor needs every gradient first);
one micro-batch per step (accumulation needs the last micro-batch's gradient); no fp16 loss scaler (it unscales and
checks all gradients first); no tensor parallel, no compile (the hook would run inside compiled blocks); on the
CPU, where FSDP2 reduce-scatters synchronously: on CUDA the sharded gradients are written on FSDP2's own stream
and torch exposes no public event to wait for, so the GPU keeps the step after backward until a GPU run tests it.

The global gradient norm is the same number `clip_grad_norm` reports: the local norms are taken as each unit is
reduced and combined in parameter order at the end. A non-finite gradient skips the whole step when it shows
in the first unit reduced (the last block: a NaN/inf loss reaches every block); the units are checked on every
rank (one flag all-reduce per unit) and none is updated from then on. Only a gradient that first turns non-finite
in a lower block while the loss is finite finds the blocks above already updated: the step is still reported
skipped and a warning says how many units were updated.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.optimization import resolve_compile


def blocker(job: SeqTrainJob, device: torch.device, tp_size: int) -> str | None:
    """Why the optimizer cannot step inside backward for this job (None: it can, with one micro-batch a step)."""
    s = job.spec
    if s.training.optimizer.name != "sgd":
        return f"optimizer {s.training.optimizer.name} (only sgd is stepped in backward)"
    if s.training.grad_clip is not None:
        return "training.gradClip (clipping needs every gradient before the first update)"
    if s.optimization.precision == "fp16":
        return "fp16 (the loss scaler unscales and checks every gradient first)"
    if tp_size > 1:
        return "tensor parallel"
    if device.type != "cpu":
        return f"{device.type} (FSDP2 reduce-scatters on its own stream there)"
    if resolve_compile(s.optimization.compile, device.type):
        return "optimization.compile"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _AfterPostBackward(torch.autograd.Function):
    """Identity on a unit's inputs, placed before FSDP2's own post-backward function: its backward runs once the
    unit's post-backward (the reduce-scatter into the sharded gradients) has run."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def step_only(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """`optimizer.step()` over `params` alone, with the groups' hyper-parameters and the optimizer's own state."""
    ids = {id(p) for p in params}
    kept = [g["params"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in ids]
        optimizer.step()
    finally:
        for g, ps in zip(optimizer.param_groups, kept, strict=True):
            g["params"] = ps


class StepInBackward:
    """Steps `optimizer` on each FSDP2 unit's parameters right after the unit's reduce-scatter, while `armed()`."""

    def __init__(self, model: nn.Module, units: Sequence[nn.Module], optimizer: torch.optim.Optimizer,
                 ctx: DistContext) -> None:
        self.model, self.optimizer, self.ctx = model, optimizer, ctx
        self.active = False
        self.announced = False  # the log says so once, at the first step that runs so
        self._reset()
        for unit in units:
            # prepend, after fully_shard: runs before FSDP2's pre-forward hook, so FSDP2 wraps the inputs this
            # hook returns and its post-backward runs first in backward
            unit.register_forward_pre_hook(self._wrap_inputs(unit), prepend=True, with_kwargs=True)

    def _reset(self) -> None:
        self.norms: dict[int, torch.Tensor] = {}  # id(param) -> norm of its local gradient shard
        self.done: set[int] = set()
        self.nonfinite = False
        self.updated = 0

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False
            if self.nonfinite and self.updated:
                warnings.warn(f"optimizer in backward: a gradient turned non-finite after {self.updated} FSDP2 "
                              "units were updated; the rest of the step was skipped", stacklevel=1)
            self._reset()

    def _wrap_inputs(self, unit: nn.Module) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not (self.active and torch.is_grad_enabled()):
                return None
            slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
            keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
            if not slots and not keys:
                return None
            out = iter(_AfterPostBackward.apply(lambda: self._step_unit(unit),
                                                *[args[i] for i in slots], *[kwargs[k] for k in keys]))
            args = tuple(next(out) if i in slots else a for i, a in enumerate(args))
            return args, {**kwargs, **{k: next(out) for k in keys}}

        return hook

    def _step_unit(self, unit: nn.Module) -> None:
        if id(unit) in self.done:
            return
        self.done.add(id(unit))
        params = [p for p in unit.parameters() if p.grad is not None]
        if not params:
            return
        norms = torch._foreach_norm([_local(p.grad) for p in params], 2.0)
        self.norms.update((id(p), n) for p, n in zip(params, norms, strict=True))
        # every rank must take the same decision for the unit: its shards on the other ranks may be the bad ones
        bad = (~torch.isfinite(torch.stack(norms))).any().float().reshape(1)
        self.ctx.all_reduce(bad, op="max", group=self.ctx.dp_group)
        if bad.item() or self.nonfinite:  # host sync: the CPU only (see blocker)
            self.nonfinite = True
        else:
            step_only(self.optimizer, params)
            self.updated += 1
        for p in params:
            p.grad = None  # the point: this unit's gradient shard is gone before the next unit's is reduced

    def global_norm(self) -> torch.Tensor:
        """The global L2 gradient norm, as `clip_grad_norm` computes it (same parameter order, same sums)."""
        rest = [(id(p), _local(p.grad)) for p in self.model.parameters() if p.grad is not None]
        fresh = dict(zip([i for i, _ in rest], torch._foreach_norm([g for _, g in rest], 2.0) if rest else [],
                         strict=True))
        norms = [self.norms.get(id(p), fresh.get(id(p))) for p in self.model.parameters()]
        norms = [n for n in norms if n is not None]
        dev = self.ctx.device
        total = torch.zeros((), dtype=torch.float64, device=dev)
        if norms:
            total += torch.stack(norms).to(device=dev, dtype=torch.float64).pow(2).sum() * 1.0
        if self.ctx.distributed:
            dist.all_reduce(total)
        return total.sqrt()
