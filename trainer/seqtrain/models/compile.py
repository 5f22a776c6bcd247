"""Model preparation after build and tensor parallelism, before the engine wraps it: activation checkpointing,
then `torch.compile` (torchtitan's order: checkpoint wrappers must exist before compiling what they wrap).

`optimization.compile` compiles each transformer block in place (`nn.Module.compile`: parameter names and
checkpoints are unchanged, and one compiled block is reused by all blocks of the same shape). Recurrent models are
left eager: their time steps already run in fused cuDNN/oneDNN kernels and their chunk loop is data-dependent.
Where no compiler backend is usable (no C++ compiler for inductor on CPU, no Triton on CUDA) the model stays
eager with a warning, and a failure while compiling falls back to eager instead of stopping the run.
"""

from __future__ import annotations

import importlib.util
import shutil
import warnings

import torch
from torch import nn

from seqtrain.spec.job import SeqTrainJob

from .checkpointing import apply_activation_checkpointing


def compile_backend_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot work here, or None when it can."""
    if not hasattr(torch, "compile"):
        return "this PyTorch has no torch.compile"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "inductor on CUDA needs triton, which is not installed"
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "inductor on CPU needs a C++ compiler (g++/clang++), none found on PATH"
    return None


def maybe_compile(model: nn.Module, device: torch.device) -> str:
    if not hasattr(model, "blocks"):
        return "torch.compile: skipped for recurrent models (fused RNN kernels already)"
    problem = compile_backend_problem(device)
    if problem is not None:
        warnings.warn(f"optimization.compile: {problem}; running eager", stacklevel=2)
        return f"torch.compile: unavailable ({problem}); eager"
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # a compile error falls back to eager for that frame
    for block in model.blocks:
        block.compile()
    return f"torch.compile: {len(model.blocks)} blocks"


def prepare_model(model: nn.Module, job: SeqTrainJob, device: torch.device) -> list[str]:
    """Apply activation checkpointing and torch.compile as the spec asks; returns log lines."""
    opt = job.spec.optimization
    lines = []
    if opt.activation_checkpointing.policy != "none":
        lines.append(apply_activation_checkpointing(model, opt.activation_checkpointing, job.spec.data.seq_len))
    if opt.compile:
        lines.append(maybe_compile(model, device))
    return lines
