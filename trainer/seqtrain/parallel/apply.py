"""Apply the layout to a freshly built model, in torchtitan's order: tensor parallel first (it changes the
modules), then activation checkpointing / compile (`seqtrain.models.compile.prepare_model`), then the engine
wraps it (DDP / FSDP2 / pipeline stages / DeepSpeed)."""

from __future__ import annotations

from torch import nn

from seqtrain.parallel.mesh import init_mesh
from seqtrain.parallel.sequence import apply_sequence_parallel
from seqtrain.parallel.tensor import apply_tensor_parallel
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob

__all__ = ["init_mesh", "parallelize"]


def parallelize(model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> nn.Module:
    if ctx.tp_size > 1:
        apply_tensor_parallel(model, ctx.tp_rank, ctx.tp_size, ctx.tp_group)
        if job.spec.optimization.sequence_parallel:
            apply_sequence_parallel(model, ctx.tp_size, ctx.tp_group)
    return model
