"""Tensor parallel (+ data parallel over the dp axis with DDP): the native engine with a mesh-wide gradient
norm and one checkpoint file per tensor-parallel shard."""

from __future__ import annotations

import math

import torch
from torch import nn

from seqtrain.engine.native import NativeEngine
from seqtrain.engine.sharded import load_shard, save_shard
from seqtrain.parallel.grads import clip_grad_norm
from seqtrain.parallel.tensor import tp_param_names
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob


class TensorParallelEngine(NativeEngine):
    name = "native-tp"
    layout_independent = False  # per-(pp, tp) shard files, resumed at any dp size on the same tp x pp

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        super().__init__(model, job, ctx)
        self.tp_names = tp_param_names(model)
        self._shard_trust_ratios(self.tp_names)

    def _clip(self) -> torch.Tensor:
        return clip_grad_norm(self.model, self.grad_clip if self.grad_clip is not None else math.inf, self.ctx,
                              self.tp_names)

    def save(self, directory: str) -> list[str]:
        return save_shard(self.ctx, self.state_dict(), directory)

    def load_legacy(self, directory: str) -> None:
        self.load_state_dict(load_shard(self.ctx, directory))
