"""Pipeline stages cut from a built model: embedding + first blocks | middle blocks | last blocks + norm + head.

Block ranges come from `seqtrain.layout.costs.stage_bounds` (balanced by forward compute, the same split
`seqtrain plan` prints). Module names keep the full model's (`blocks.3.attn.q.weight`), so a stage's state
dict is a slice of the single-process one. With tied embeddings the last stage keeps its own copy of the
embedding matrix as the output projection; the engine sums the two copies' gradients after each step
(Megatron's embedding group), so both stay equal to the single-process tied weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from seqtrain.data import IGNORE_INDEX
from seqtrain.layout.costs import stage_bounds
from seqtrain.models.loss import linear_cross_entropy
from seqtrain.parallel.sequence import gather_rows
from seqtrain.parallel.tensor import copy_to_tp, vocab_parallel_cross_entropy

TIED_COPY = "output.weight"  # name of the last stage's copy of a tied embedding


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: it is sent to the previous stage as is, and
    nn.LSTM/GRU return strided input gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class Stage(nn.Module):
    """One pipeline stage: forward(x) where x is tokens [B, T] on the first stage, hidden [B, T, D] after."""

    def __init__(self, model: nn.Module, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.is_gpt = hasattr(model, "blocks")
        self.embed = model.embed if first else None
        self.drop = model.drop
        layers = model.blocks if self.is_gpt else model.layers
        self.num_layers = len(layers)
        self.block_ids = list(range(start, end))
        mods = nn.ModuleDict({str(i): layers[i] for i in self.block_ids})
        if self.is_gpt:
            self.blocks = mods
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        else:
            self.layers = mods
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.output = None
        if last and model.lm_head is None:
            if first:
                self.output = None  # single stage: the embedding itself
            else:
                # On the embedding's own device and dtype: manual PipelineStage never moves modules, so a copy
                # built on the default (CPU) device would crash the first CUDA step.
                w = model.embed.weight
                self.output = nn.Embedding(w.shape[0], w.shape[1], device=w.device, dtype=w.dtype)
                if w.device.type != "meta":  # a meta model is materialised and initialised later
                    with torch.no_grad():
                        self.output.weight.copy_(w)
        self.tp_group = getattr(getattr(model, "lm_loss", None), "group", None)
        self.sp_size = getattr(model, "sp_size", 1)  # sequence parallel: activations are [B, T / sp_size, D]
        self.use_kernels = getattr(model, "use_kernels", False)  # fused loss (seqtrain.models.dispatch)
        self.vocab_start = getattr(model.embed, "start", 0)

    @property
    def output_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.output is not None:
            return self.output.weight
        assert self.embed is not None
        return self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.embed(x))
        elif x.requires_grad:
            x = _ContiguousGrad.apply(x)
        if self.is_gpt:
            t = x.shape[1] * self.sp_size  # RoPE tables for the whole sequence (attention sees all of it)
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
            for i in self.block_ids:
                x = self.blocks[str(i)](x, cos, sin, None)
        else:
            for i in self.block_ids:
                x, _ = self.layers[str(i)](x)  # zero initial state, as the unsplit model without packing
                if i < self.num_layers - 1:
                    x = self.drop(x)
        if self.last:
            x = self.norm(x)
        return x.contiguous()  # sent to the next stage as is (nn.LSTM's batch-first output is a strided view)

    def loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy SUM of the last stage's output (vocabulary-parallel under tensor parallel)."""
        if self.tp_group is not None:
            if self.sp_size > 1:
                h = gather_rows(hidden, targets, self.tp_group, self.sp_size)
            else:
                h = copy_to_tp(hidden.reshape(-1, hidden.shape[-1]), self.tp_group)
            return vocab_parallel_cross_entropy(h @ self.output_weight.t(), targets.reshape(-1), self.vocab_start,
                                                self.tp_group, IGNORE_INDEX)
        return linear_cross_entropy(hidden, self.output_weight, targets, kernels=self.use_kernels)


def build_stages(model: nn.Module, bounds: list[tuple[int, int]], indices: list[int]) -> list[Stage]:
    """Stages `indices` (global stage numbers) of a model split at `bounds`."""
    n = len(bounds)
    return [Stage(model, bounds[i][0], bounds[i][1], first=i == 0, last=i == n - 1) for i in indices]


def layout(job: Any, pp_size: int, pp_rank: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(block bounds of every stage, this rank's stage numbers): interleaved ranks hold stages r, r + pp, ..."""
    from seqtrain.layout.topology import INTERLEAVED_CHUNKS
    from seqtrain.spec.resolve import resolved_model

    chunks = INTERLEAVED_CHUNKS if job.spec.optimization.pipeline_schedule == "interleaved" else 1
    bounds = stage_bounds(resolved_model(job), pp_size * chunks, job.spec.data.seq_len)
    return bounds, [pp_rank + k * pp_size for k in range(chunks)]


def local_modules(job: Any, pp_size: int, pp_rank: int) -> list[str] | None:
    """Names of the submodules a pipeline rank materialises (None without pipeline parallel: all of them).

    The last stage of a tied model also gets the embedding, only long enough for its stage to copy it as the
    output projection (`PipelineEngine` frees it again)."""
    if pp_size == 1:
        return None
    bounds, ids = layout(job, pp_size, pp_rank)
    container = "blocks" if job.spec.model.arch == "gpt" else "layers"
    last = len(bounds) - 1
    names = [f"{container}.{b}" for i in ids for b in range(*bounds[i])]
    if 0 in ids or (last in ids and job.spec.model.tie_embeddings):
        names.append("embed")
    if last in ids:
        names.append("norm")
        if not job.spec.model.tie_embeddings:
            names.append("lm_head")
    return names


def stray_tensors(module: nn.Module, device: torch.device) -> list[str]:
    """Names of the parameters and buffers of `module` that are not on `device` (a CUDA index of None matches
    any index). PipelineStage runs its module where it is, so one stray tensor fails the first step."""
    def elsewhere(t: torch.Tensor) -> bool:
        return t.device.type != device.type or (device.index is not None and t.device.index != device.index)

    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return [f"{n} ({t.device})" for n, t in named if elsewhere(t)]


def check_stage_device(stage: nn.Module, device: torch.device) -> None:
    stray = stray_tensors(stage, device)
    if stray:
        raise RuntimeError(f"pipeline stage tensors not on {device}: {', '.join(stray[:5])}"
                           f"{' ...' if len(stray) > 5 else ''} (every stage module must be built on its device)")


def schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[name]
