"""Training engines. `build_engine(model, job, ctx)` picks one by `spec.optimization.engine`.

Engines register in ENGINES by name; "auto" resolves in `engine_name`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from seqtrain.engine.base import Engine, StepStats
from seqtrain.engine.native import NativeEngine
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob

__all__ = ["ENGINES", "Engine", "NativeEngine", "StepStats", "build_engine", "engine_name"]

ENGINES: dict[str, Callable[[nn.Module, SeqTrainJob, DistContext], Engine]] = {"native": NativeEngine}


def engine_name(job: SeqTrainJob) -> str:
    opt = job.spec.optimization
    if opt.engine == "auto":
        return "deepspeed" if opt.zero.stage > 0 else "native"
    return opt.engine


def build_engine(model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> Engine:
    # the layout (tp/pp) and ZeRO stage pick the class: DDP, FSDP2, tensor/pipeline parallel or DeepSpeed
    from seqtrain.engine.select import create_engine

    return create_engine(model, job, ctx)
