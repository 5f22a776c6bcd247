"""Mixed precision: autocast on the device in use, fp32 master weights, dynamic loss scaling for fp16.

Parameters and optimizer states always stay fp32; only the forward (and so the saved activations) runs in
bf16/fp16 under `torch.autocast`. fp16 has a narrow exponent range, so small gradients underflow to zero: the
loss is multiplied by a large scale before backward and the gradients are divided by it before the update
(`DynamicLossScaler`). When a gradient overflows to inf/NaN the step is skipped and the scale halved; after
`growth_interval` good steps in a row it doubles again. bf16 has fp32's exponent range and needs no scaling.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.optimization import resolve_compile, resolve_precision

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DynamicLossScaler:
    """Loss scale that halves on overflow (skipping that update) and grows after `growth_interval` good steps."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 2.0**-14,
        max_scale: float = 2.0**24,
    ) -> None:
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1):
            raise ValueError("loss scaler needs growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, params: Iterable[torch.nn.Parameter], group: Any = None) -> bool:
        """Divide every gradient by the scale in place; True when any gradient is inf/NaN (on any rank).

        One host sync (the flag's `.item()`): the caller must know now whether to apply the update. With
        sharded gradients (ZeRO/FSDP) ranks see different shards, so the flag is max-reduced over `group`.
        """
        grads = [p.grad for p in params if p.grad is not None]
        found = _unscale_grads(grads, 1.0 / self.scale)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())  # sync: decides whether the optimizer steps

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _unscale_grads(grads: list[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply grads by inv_scale in place; return a float flag tensor (1.0 = some value is not finite)."""
    if not grads:
        return torch.zeros(1)
    device = grads[0].device
    found = torch.zeros(1, device=device)
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), group in by_device.items():
        flag = torch.zeros(1, device=dev)
        inv = torch.full((1,), inv_scale, device=dev)
        try:  # the fused kernel PyTorch's own GradScaler uses (CPU and CUDA)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
        except (AttributeError, RuntimeError):
            for g in group:
                flag = torch.maximum(flag, (~torch.isfinite(g)).any().float().reshape(1))
                g.mul_(inv_scale)
        found = torch.maximum(found, flag.to(device))
    return found


def bf16_supported(device: torch.device) -> bool:
    """Whether `device` runs bf16 matmuls natively (Ampere and newer). The CPU answers False: `auto` keeps it fp32."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_auto(job: SeqTrainJob, device: torch.device) -> SeqTrainJob:
    """The job with `optimization.precision` and `optimization.compile` resolved for this rank's device, so that
    every component (engines, kernels, MFU peaks) reads one concrete value. `auto` is bf16 and compiled blocks on a
    bf16-capable CUDA GPU, fp32 and eager on the CPU (its numerics unchanged); explicit values are kept."""
    opt = job.spec.optimization
    precision = resolve_precision(opt.precision, device.type, bf16_supported(device))
    compile_ = resolve_compile(opt.compile, device.type)
    if precision == opt.precision and compile_ is opt.compile:
        return job
    spec = job.spec.model_copy(update={"optimization": opt.model_copy(update={"precision": precision,
                                                                             "compile": compile_})})
    return job.model_copy(update={"spec": spec})


class MixedPrecision:
    """What the engine needs from precision: autocast, (scaled) backward, unscale + overflow check, scale update."""

    def __init__(self, precision: str, device: torch.device | str, growth_interval: int = 1000,
                 init_scale: float = 2.0**16) -> None:
        precision = resolve_precision(precision, torch.device(device).type, bf16_supported(torch.device(device)))
        if precision not in DTYPES:
            raise ValueError(f"optimization.precision: {precision!r} is not one of {sorted(DTYPES)}")
        self.name = precision
        self.device = torch.device(device)
        self.dtype = DTYPES[precision]
        if precision == "fp16" and self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("optimization.precision fp16 on cuda needs a GPU")
        if precision == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise RuntimeError("optimization.precision: this GPU has no bf16 support; use fp16 or fp32")
        self.scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=growth_interval) \
            if precision == "fp16" else None

    @property
    def enabled(self) -> bool:
        return self.name != "fp32"

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.scale if self.scaler else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast for the forward pass and loss (backward runs outside it, as PyTorch recommends)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale_loss(loss) if self.scaler else loss).backward()

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter], group: Any = None) -> bool:
        """Undo the loss scale on the gradients; True when the step must be skipped (inf/NaN gradient).

        Without a scaler (fp32/bf16) only the finiteness check runs; the engine also checks the clipped norm.
        """
        if self.scaler is not None:
            return self.scaler.unscale_(params, group)
        return False

    def update(self, found_inf: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(found_inf)

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.name, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class MasterWeights:
    """bf16 parameters and gradients with fp32 master weights inside the optimizer step (`paramDtype: bf16`).

    The model's trained parameters become bf16 (forward and backward read them without a per-micro-batch cast;
    gradients are bf16, half the bytes to reduce). Each has an fp32 master, and the optimizer steps the masters:
    `step_grads()` hands them the bf16 gradients as fp32 ones, so clipping, the update and the optimizer's fp32
    state are what fp32 parameters get; `refresh()` rounds every master into its bf16 parameter (the only
    rounding). The parameters themselves are never swapped (a dtype change through `.data` would drop the hooks
    DDP registered on their gradient accumulators).

    `module` is a plain module that holds the same names as the model: the fp32 masters where the model trains a
    parameter, the model's own frozen parameters (LoRA's base) and buffers elsewhere. Checkpoints and state dicts
    read and write it, so they hold the fp32 masters under the model's names: resume is exact and the format is
    that of fp32 parameters."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.module = torch.nn.Module()
        master_of: dict[int, torch.nn.Parameter] = {}
        self.params: list[torch.nn.Parameter] = []  # the model's trained parameters, each once (tied ones too)
        self.masters: list[torch.nn.Parameter] = []
        for name, p in model.named_parameters(remove_duplicate=False):
            if p.requires_grad and p.is_floating_point():
                if id(p) not in master_of:
                    # an fp32 parameter's own storage becomes its master; the bf16 copy is allocated below
                    master_of[id(p)] = torch.nn.Parameter(p.detach().float())
                    self.params.append(p)
                    self.masters.append(master_of[id(p)])
                _place(self.module, name, master_of[id(p)])
            else:
                _place(self.module, name, p)
        owners = dict(model.named_modules(remove_duplicate=False))
        for name, b in model.named_buffers(remove_duplicate=False):
            owner, _, leaf = name.rpartition(".")
            _place(self.module, name, b, persistent=leaf not in owners[owner]._non_persistent_buffers_set)
        for p in self.params:
            p.data = p.data.to(dtype)
        for group in optimizer.param_groups:  # the optimizer, built over the model, steps the masters instead
            group["params"] = [master_of.get(id(p), p) for p in group["params"]]

    def step_grads(self) -> None:
        """The model's bf16 gradients as the masters' fp32 gradients; the bf16 ones are dropped."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Round every master into its bf16 parameter (after an update or a load), in one launch."""
        torch._foreach_copy_(self.params, self.masters)


def _place(root: torch.nn.Module, name: str, tensor: torch.Tensor, persistent: bool = True) -> None:
    """Register `tensor` at dotted `name` under `root`, creating plain modules on the way (a parameter or buffer)."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if part not in module._modules:
            module.add_module(part, torch.nn.Module())
        module = module._modules[part]
    if isinstance(tensor, torch.nn.Parameter):
        module.register_parameter(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)


def grads_finite(params: Iterable[torch.nn.Parameter]) -> bool:
    """True when every gradient is finite (one host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    norms = torch.stack([g.detach().float().abs().max() for g in grads])
    return bool(torch.isfinite(norms).all().item())


def is_finite(x: float | torch.Tensor) -> bool:
    return math.isfinite(float(x))


@contextlib.contextmanager
def no_autocast(device_type: str) -> Iterator[None]:
    """Run a region in full precision inside an autocast forward (e.g. the loss's log-softmax)."""
    with torch.autocast(device_type=device_type, enabled=False):
        yield


def enable_tf32(device: torch.device, deterministic: bool) -> str:
    """TF32 tensor cores for fp32 matmuls and convolutions on Ampere and newer (10-bit mantissa products,
    fp32 accumulation: what torchtitan and Megatron run). Off under training.deterministic, and off on older
    GPUs and the CPU, where it does not exist. Returns the log line."""
    if device.type != "cuda":
        return "tf32: not applicable (no CUDA)"
    if deterministic:
        return "tf32: off (training.deterministic: full fp32 matmuls)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"tf32: unavailable (compute capability {major}.x < 8.0)"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return "tf32: on for fp32 matmuls (Ampere or newer)"
