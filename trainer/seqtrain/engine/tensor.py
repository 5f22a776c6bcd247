"""Tensor parallel (+ data parallel over the dp axis with DDP): the native engine with a mesh-wide gradient
norm, checkpointed in the layout-independent DCP format: each slice is recorded as a part of the full tensor
(`seqtrain.engine.global_state`), so any engine, tensor-parallel degree or data-parallel size resumes it."""

from __future__ import annotations

import math

import torch
from torch import nn

from seqtrain.engine.global_state import GlobalState
from seqtrain.engine.native import NativeEngine
from seqtrain.parallel.grads import clip_grad_norm
from seqtrain.parallel.tensor import tp_param_names, tp_shard_dims
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob


class TensorParallelEngine(NativeEngine):
    name = "native-tp"

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        super().__init__(model, job, ctx)
        self.tp_names = tp_param_names(model)
        self._shard_trust_ratios(self.tp_names)
        mesh = ctx.mesh["tp"] if ctx.mesh is not None else None
        self.global_state = GlobalState(model, lambda name: name, tp_shard_dims(model), mesh)

    def _clip(self) -> torch.Tensor:
        return clip_grad_norm(self.model, self.grad_clip if self.grad_clip is not None else math.inf, self.ctx,
                              self.tp_names)
