"""Which engine class runs a job: the layout (tp, pp) and ZeRO stage decide (table in seqtrain.layout.rules).

native + pp > 1         -> PipelineEngine (tensor parallel inside stages, data parallel across pipelines)
native + zero.stage 3   -> FSDPEngine (FSDP2; tensor parallel inside)
native + tp > 1         -> TensorParallelEngine (DDP over dp)
native                  -> NativeEngine (DDP), with the gradient-compression hook when asked
deepspeed (or auto with zero.stage > 0) -> DeepSpeedEngine
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from seqtrain.engine.base import Engine
from seqtrain.layout.rules import engine_of
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob


def create_engine(model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> Engine:
    kind = engine_of(job)
    opt = job.spec.optimization
    if kind == "deepspeed":
        from seqtrain.engine.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model, job, ctx)
    if opt.pipeline_parallel > 1:
        from seqtrain.engine.pipeline import PipelineEngine

        return PipelineEngine(model, job, ctx)
    if kind == "fsdp2":
        from seqtrain.engine.fsdp import FSDPEngine

        return FSDPEngine(model, job, ctx)
    if opt.tensor_parallel > 1:
        from seqtrain.engine.tensor import TensorParallelEngine

        engine: Engine = TensorParallelEngine(model, job, ctx)
    else:
        from seqtrain.engine.native import NativeEngine

        engine = NativeEngine(model, job, ctx)
    wrapped = getattr(engine, "wrapped", None)
    if opt.grad_compression != "none" and isinstance(wrapped, DDP):
        register_compression(wrapped, opt.grad_compression, ctx)
    return engine


def register_compression(ddp: DDP, kind: str, ctx: DistContext) -> None:
    """All-reduce gradients in bf16/fp16 (half the bytes; the sum is cast back to fp32 before the update)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = default_hooks.bf16_compress_hook if kind == "bf16" else default_hooks.fp16_compress_hook
    ddp.register_comm_hook(ctx.dp_group, hook)
