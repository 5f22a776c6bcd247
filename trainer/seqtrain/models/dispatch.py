"""`optimization.kernels`: decide once per run whether the models call `seqtrain.kernels`, and switch them.

Resolution (`resolve_kernels`), in order:
1. `SEQTRAIN_KERNELS=torch` forces the reference, whatever the spec says.
2. `optimization.kernels: false` -> reference.
3. Unset -> per op, from the first GPU lease's measurements (docs/benchmarks.md, one H100, 2026-11-26): on CUDA
   where Triton runs, `linear_scan` (QRNN's fo-pooling; 2.6-4.5x the reference there) is on (`CUDA_DEFAULT_ON`);
   every other op takes the reference (PyTorch SDPA / flex_attention, and torch.compile's fusion when
   `optimization.compile` is on), since the kernels lost to it or won only where compiled blocks cannot call them
   (packed-document attention beat flex_attention 1.67x, but inside a compiled block the kernel's autograd
   Function would break the graph). On the CPU a run with the field unset never imports triton.
4. On (true) -> the Triton path where it can run on this device (CUDA, or the CPU with
   `TRITON_INTERPRET=1`, and triton imports); otherwise the reference, with the reason in the log line.
   `SEQTRAIN_KERNELS=triton` where Triton cannot run is an error, not a fallback.

`apply_kernels` sets `use_kernels` on the modules that have a kernel path: `RMSNorm` (rms_norm, the q/k norms of
qkNorm included), `LayerNorm` (layer_norm), `SwiGLU` (swiglu; the GELU MLP has none), `CausalSelfAttention` (rope
unless positions are learned, flash attention with doc_ids for packing; the flash kernel has no sliding window, so
where slidingWindow hides positions the block's attention is the masked reference), `QRNNLayer` (linear_scan for
fo-pooling) and the model itself (the loss: fused linear + cross-entropy). It is a per-instance attribute, so
it survives tensor parallel's class swap, pipeline stages (which reuse the modules), activation checkpointing
(recomputation calls the same forward) and FSDP2/DeepSpeed wrapping. Two combinations keep a reference piece:
- tensor parallel: the loss stays the vocabulary-parallel cross-entropy (the fused kernel needs the whole
  vocabulary on one rank); the blocks use the kernels on their local heads and hidden units.
- torch.compile: compiled transformer blocks keep the reference ops, which inductor fuses itself (the kernels'
  autograd Functions are not traced through); the final norm and the loss, outside the blocks, use the kernels.

`optimization.fusedProjections` (`resolve_fused_projections` in seqtrain.spec.optimization; `setup_fused_projections`
here) sets `fuse_projections` the same way, per instance, on `CausalSelfAttention` and `SwiGLU`: q/k/v and gate/up
run as one GEMM each (`seqtrain.models.layers.fused_linear`), with tensor and sequence parallel's subclasses and
the KV-cache decoder included.
"""

from __future__ import annotations

import torch
from torch import nn

from seqtrain.kernels._runtime import (
    ENV_BACKEND,
    backend_for,
    forced_backend,
    interpret_requested,
    triton_import_error,
)
from seqtrain.models.compile import compile_backend_problem
from seqtrain.models.layers import fusable
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.optimization import resolve_compile, resolve_fused_projections


def resolve_kernels(setting: bool | None, device: torch.device) -> tuple[bool, str]:
    """(use the kernels, why) for `optimization.kernels` = `setting` on `device`."""
    if forced_backend() == "torch":
        return False, f"off ({ENV_BACKEND}=torch forces the PyTorch reference)"
    if setting is False:
        return False, "off (optimization.kernels: false)"
    if setting is None:
        if device.type == "cuda":
            return False, ("off (default: PyTorch SDPA/flex_attention and torch.compile until `seqtrain bench gpu` "
                           "measures the Triton kernels faster; optimization.kernels: true opts in)")
        return False, "off (default on the CPU; optimization.kernels: true with TRITON_INTERPRET=1 runs them here)"
    source = "optimization.kernels: true"
    # backend_for raises for SEQTRAIN_KERNELS=triton where Triton cannot run. It imports triton only when the
    # probe is on CUDA or TRITON_INTERPRET=1 is set.
    if backend_for(torch.empty(0, device=device)) == "triton":
        mode = "Triton interpreter" if device.type == "cpu" else "Triton"
        return True, f"on ({source}; {mode})"
    if device.type == "cpu" and not interpret_requested():
        why = "TRITON_INTERPRET=1 is not set on this CPU run"
    else:
        why = f"triton cannot be imported: {triton_import_error()}"
    return False, f"off ({source}, but {why}; using the PyTorch reference)"


# Module classes whose kernel is on by default on CUDA (optimization.kernels unset): where a lease measured it faster.
CUDA_DEFAULT_ON = ("QRNNLayer",)


def _triton_runs_on(device: torch.device) -> bool:
    return backend_for(torch.empty(0, device=device)) == "triton"


def default_kernel_modules(model: nn.Module, device: torch.device) -> list[str]:
    """With optimization.kernels unset: the modules whose kernel the measurements switch on for this device (none on
    the CPU, none where SEQTRAIN_KERNELS=torch, none where Triton cannot run); switches them and returns their names."""
    picked = [(n, m) for n, m in model.named_modules() if type(m).__name__ in CUDA_DEFAULT_ON]
    if device.type != "cuda" or not picked or forced_backend() == "torch" or not _triton_runs_on(device):
        return []
    for _, module in picked:
        module.use_kernels = True
    return [n for n, _ in picked]


def apply_kernels(model: nn.Module, enabled: bool, *, skip_blocks: bool = False) -> list[str]:
    """Set `use_kernels` on every module with a kernel path (and on the model, for the loss); returns the names
    of the switched modules. `skip_blocks`: leave `model.blocks` on the reference (torch.compile fuses them)."""
    skipped: set[int] = set()
    if skip_blocks:
        skipped = {id(m) for m in getattr(model, "blocks", nn.ModuleList()).modules()}
    switched = []
    for name, module in model.named_modules():
        if hasattr(type(module), "use_kernels") and id(module) not in skipped:
            module.use_kernels = enabled
            switched.append(name)
    model.use_kernels = enabled  # read by the loss (CausalLMLoss, pipeline stages)
    return switched


def setup_kernels(model: nn.Module, job: SeqTrainJob, device: torch.device) -> str:
    """Resolve `optimization.kernels` for this run and switch the model; returns the log line."""
    opt = job.spec.optimization
    enabled, why = resolve_kernels(opt.kernels, device)
    compiled = (enabled and resolve_compile(opt.compile, device.type) and hasattr(model, "blocks")
                and compile_backend_problem(device) is None)
    apply_kernels(model, enabled, skip_blocks=compiled)
    line = f"kernels: {why}"
    if opt.kernels is None and (defaults := default_kernel_modules(model, device)):
        line = (f"kernels: linear_scan on by default on CUDA for {len(defaults)} layer(s) (measured faster); "
                f"the rest {why}")
    if enabled and getattr(model, "lm_loss", None) is not None:
        line += "; loss: vocabulary-parallel reference (tensor parallel)"
    if compiled:
        line += "; compiled blocks: torch.compile's own fusion"
    return line


def apply_fused_projections(model: nn.Module, enabled: bool) -> tuple[int, int]:
    """Set `fuse_projections` on every module with a fused path (attention q/k/v, SwiGLU gate/up); returns (modules
    that fuse, modules switched): a module whose linears are not all plain `nn.Linear` (LoRA) keeps them split."""
    fused = switched = 0
    for module in model.modules():
        if hasattr(type(module), "fuse_projections"):
            module.fuse_projections = enabled
            switched += 1
            fused += enabled and fusable(module.projections())
    return fused, switched


def setup_fused_projections(model: nn.Module, job: SeqTrainJob) -> str:
    """Resolve `optimization.fusedProjections` for this run and switch the model; returns the log line."""
    enabled, why = resolve_fused_projections(job.spec.optimization)
    fused, switched = apply_fused_projections(model, enabled)
    line = f"fused projections: {why}"
    if enabled and fused < switched:
        line += f"; {switched - fused} of {switched} layers keep split projections (LoRA or non-plain linears)"
    return line
