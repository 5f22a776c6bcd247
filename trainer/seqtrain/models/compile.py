"""Model preparation after build and tensor parallelism, before the engine wraps it: activation checkpointing,
then `torch.compile` (torchtitan's order: checkpoint wrappers must exist before compiling what they wrap).

`optimization.compile` (`auto`, the default: on with CUDA, off on the CPU) compiles each transformer block in
place (`nn.Module.compile`: parameter names and checkpoints are unchanged, and one compiled block is reused by
all blocks of the same shape). Recurrent models are left eager: their time steps already run in fused cuDNN/oneDNN kernels and their chunk loop is data-dependent.
Where no compiler backend is usable (no C++ compiler for inductor on CPU, no Triton on CUDA) the model stays
eager with a warning. A block whose compilation fails falls back to eager with a warning that names the block
and the error, and the failure is recorded on the block (`CompileState`): `compile_report(model)` counts the
blocks that ran compiled, the failures, graphs, graph breaks and recompiles, so a run (and `seqtrain bench gpu`)
says whether its blocks really compiled rather than what was asked. dynamo's global `suppress_errors` is never
set, so a failure elsewhere is never silent.
"""

from __future__ import annotations

import importlib.util
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqtrain.models.activation_checkpointing import apply_activation_checkpointing
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.optimization import resolve_compile


def compile_backend_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot work here, or None when it can."""
    if not hasattr(torch, "compile"):
        return "this PyTorch has no torch.compile"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "inductor on CUDA needs triton, which is not installed"
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "inductor on CPU needs a C++ compiler (g++/clang++), none found on PATH"
    return None


@dataclass
class CompileState:
    """What happened to one compiled module: calls that ran compiled, compiler failures (and the last error)."""

    name: str
    compiled_calls: int = 0
    failures: int = 0
    error: str | None = None

    @property
    def eager(self) -> bool:
        """True once a compiler failure left the module eager (it is not compiled again: one failure per
        step would cost a compile attempt per step)."""
        return self.failures > 0


def compile_with_fallback(module: nn.Module, name: str, backend: str | Callable[..., Any] = "inductor") -> None:
    """`module.compile()`, except that a compiler failure (dynamo or the backend) on a call warns, naming
    `name` and the error, records it in `module.compile_state` and leaves this module eager from then on.
    Errors of the model itself are not compiler failures: the eager retry raises them as usual."""
    from torch._dynamo.exc import TorchDynamoException

    compiled = torch.compile(module._call_impl, backend=backend)
    state = CompileState(name)
    module.compile_state = state

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            out = compiled(*args, **kwargs)
        except TorchDynamoException as err:
            cause = getattr(err, "inner_exception", None) or err.__cause__ or err  # the backend's own error
            first = f"{type(cause).__name__}: " + (str(cause).strip().splitlines() or [""])[0][:200]
            state.failures += 1
            state.error = f"{type(err).__name__}: {first}"
            warnings.warn(f"optimization.compile: torch.compile failed for {name} ({state.error});"
                          f" {name} runs eager", stacklevel=2)
            module._compiled_call_impl = None
            return module._call_impl(*args, **kwargs)
        state.compiled_calls += 1
        return out

    module._compiled_call_impl = call  # what nn.Module.compile sets: __call__ uses it


def dynamo_counts() -> dict[str, int]:
    """Process-wide dynamo figures since the last `torch._dynamo.reset()`: graphs compiled, graph breaks and
    recompiles (guard failures). A compiled block with breaks or recompiles is slower than it looks."""
    from torch._dynamo.utils import counters

    guard_failures = getattr(torch._dynamo, "guard_failures", {})
    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(len(v) for v in guard_failures.values()))}


def compile_report(model: nn.Module) -> dict[str, Any]:
    """Whether the model's blocks really ran compiled: per-block states (`compile_with_fallback`) and dynamo's
    counts. `compiled_blocks` counts blocks that completed at least one compiled call and never failed."""
    states = [m.compile_state for m in model.modules() if isinstance(getattr(m, "compile_state", None),
                                                                      CompileState)]
    failed = {s.name: s.error for s in states if s.failures}
    return {"blocks": len(states),
            "compiled_blocks": sum(1 for s in states if s.compiled_calls and not s.failures),
            "failures": sum(s.failures for s in states), "eager_after_failure": failed, **dynamo_counts()}


def maybe_compile(model: nn.Module, device: torch.device, backend: str | Callable[..., Any] = "inductor") -> str:
    if not hasattr(model, "blocks"):
        return "torch.compile: skipped for recurrent models (fused RNN kernels already)"
    problem = compile_backend_problem(device)
    if problem is not None:
        warnings.warn(f"optimization.compile: {problem}; running eager", stacklevel=2)
        return f"torch.compile: unavailable ({problem}); eager"
    for i, block in enumerate(model.blocks):
        compile_with_fallback(block, f"blocks.{i}", backend)
    return (f"torch.compile: {len(model.blocks)} blocks (a block that fails to compile warns, runs eager and is "
            "counted in compile_report)")


def prepare_model(model: nn.Module, job: SeqTrainJob, device: torch.device) -> list[str]:
    """Apply activation checkpointing and torch.compile as the spec asks; returns log lines."""
    opt = job.spec.optimization
    lines = []
    if opt.activation_checkpointing.policy != "none":
        lines.append(apply_activation_checkpointing(model, opt.activation_checkpointing, job.spec.data.seq_len))
    if resolve_compile(opt.compile, device.type):  # auto: on with CUDA, off on the CPU
        lines.append(maybe_compile(model, device))
    return lines
