"""Tensor parallel (+ data parallel over the dp axis with DDP): the native engine with a mesh-wide gradient
norm, checkpointed in the layout-independent DCP format.

The model's tensor-parallel slices are plain tensors (`seqtrain.parallel.tensor` says why), so the checkpoint tree
wraps each one, and its optimizer state, in a DTensor over the tp sub-mesh that says where the slice lies in the
full tensor (`Shard(dim)` of the full shape): DCP then records full shapes under the single-process names, like
every other layout-independent engine, and any engine, tensor-parallel degree or data-parallel size resumes it
(DCP reads each rank's slice out of whatever chunks were written). The wrapping shares storage: no copy.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from seqtrain.engine.native import NativeEngine
from seqtrain.engine.sharded import load_shard
from seqtrain.parallel.grads import clip_grad_norm
from seqtrain.parallel.tensor import tp_param_names, tp_shard_dims
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob


class TensorParallelEngine(NativeEngine):
    name = "native-tp"

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        super().__init__(model, job, ctx)
        self.tp_names = tp_param_names(model)
        self.shard_dims = tp_shard_dims(model)
        self._local_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self._shard_trust_ratios(self.tp_names)

    def _clip(self) -> torch.Tensor:
        return clip_grad_norm(self.model, self.grad_clip if self.grad_clip is not None else math.inf, self.ctx,
                              self.tp_names)

    def _global(self, fqn: str, value: Any) -> Any:
        """`value` (a slice of parameter `fqn`, or a same-shaped optimizer state) as a DTensor of the full shape."""
        spec = self.shard_dims.get(fqn)
        if spec is None or self.ctx.mesh is None or not isinstance(value, torch.Tensor):
            return value
        dim, full = spec
        if tuple(value.shape) != self._local_shapes.get(fqn):  # e.g. AdamW's scalar step: the same on every rank
            return value
        from torch.distributed.tensor import DTensor, Shard

        shape = list(value.shape)
        shape[dim] = full
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(value, self.ctx.mesh["tp"], [Shard(dim)], run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def checkpoint_state(self) -> dict[str, Any]:
        tree = super().checkpoint_state()
        tree["model"] = {k: self._global(k, v) for k, v in tree["model"].items()}
        optim = {}
        for key, value in tree["optim"].items():
            # flattened names: state.<fqn>.<state key> (the state key has no dot) and param_groups.<fqn>.<key>
            fqn = key[len("state."):].rsplit(".", 1)[0] if key.startswith("state.") else None
            optim[key] = self._global(fqn, value) if fqn is not None else value
        tree["optim"] = optim
        return tree

    def _local_state(self, tree: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        def local(value: Any) -> Any:
            return value.to_local() if isinstance(value, DTensor) else value

        return {**tree, "model": {k: local(v) for k, v in tree["model"].items()},
                "optim": {k: local(v) for k, v in tree["optim"].items()}}

    def load_legacy(self, directory: str) -> None:
        """A checkpoint from before the DCP format: this rank's `engine-pp0-tp<r>.pt` (same tp degree only)."""
        self.load_state_dict(load_shard(self.ctx, directory))
