"""Model preparation after build and tensor parallelism, before the engine wraps it: activation checkpointing,
then `torch.compile` (torchtitan's order: checkpoint wrappers must exist before compiling what they wrap).

`optimization.compile` compiles each transformer block in place (`nn.Module.compile`: parameter names and
checkpoints are unchanged, and one compiled block is reused by all blocks of the same shape). Recurrent models are
left eager: their time steps already run in fused cuDNN/oneDNN kernels and their chunk loop is data-dependent.
Where no compiler backend is usable (no C++ compiler for inductor on CPU, no Triton on CUDA) the model stays
eager with a warning. A block whose compilation fails falls back to eager with a warning that names the block
and the error; dynamo's global `suppress_errors` is never set, so a failure elsewhere is never silent.
"""

from __future__ import annotations

import importlib.util
import shutil
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from seqtrain.models.activation_checkpointing import apply_activation_checkpointing
from seqtrain.spec.job import SeqTrainJob


def compile_backend_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot work here, or None when it can."""
    if not hasattr(torch, "compile"):
        return "this PyTorch has no torch.compile"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "inductor on CUDA needs triton, which is not installed"
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "inductor on CPU needs a C++ compiler (g++/clang++), none found on PATH"
    return None


def compile_with_fallback(module: nn.Module, name: str, backend: str | Callable[..., Any] = "inductor") -> None:
    """`module.compile()`, except that a compiler failure (dynamo or the backend) on a call warns, naming
    `name` and the error, and leaves this module eager from then on. Errors of the model itself are not
    compiler failures: the eager retry raises them as usual."""
    from torch._dynamo.exc import TorchDynamoException

    compiled = torch.compile(module._call_impl, backend=backend)

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except TorchDynamoException as err:
            cause = getattr(err, "inner_exception", None) or err.__cause__ or err  # the backend's own error
            first = f"{type(cause).__name__}: " + (str(cause).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"optimization.compile: torch.compile failed for {name} ({type(err).__name__}: {first});"
                          f" {name} runs eager", stacklevel=2)
            module._compiled_call_impl = None
            return module._call_impl(*args, **kwargs)

    module._compiled_call_impl = call  # what nn.Module.compile sets: __call__ uses it


def maybe_compile(model: nn.Module, device: torch.device, backend: str | Callable[..., Any] = "inductor") -> str:
    if not hasattr(model, "blocks"):
        return "torch.compile: skipped for recurrent models (fused RNN kernels already)"
    problem = compile_backend_problem(device)
    if problem is not None:
        warnings.warn(f"optimization.compile: {problem}; running eager", stacklevel=2)
        return f"torch.compile: unavailable ({problem}); eager"
    for i, block in enumerate(model.blocks):
        compile_with_fallback(block, f"blocks.{i}", backend)
    return f"torch.compile: {len(model.blocks)} blocks (a block that fails to compile warns and runs eager)"


def prepare_model(model: nn.Module, job: SeqTrainJob, device: torch.device) -> list[str]:
    """Apply activation checkpointing and torch.compile as the spec asks; returns log lines."""
    opt = job.spec.optimization
    lines = []
    if opt.activation_checkpointing.policy != "none":
        lines.append(apply_activation_checkpointing(model, opt.activation_checkpointing, job.spec.data.seq_len))
    if opt.compile:
        lines.append(maybe_compile(model, device))
    return lines
