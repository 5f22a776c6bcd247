"""FSDP2 (`fully_shard`): the torch-native ZeRO-3. Parameters, gradients and optimizer states are sharded over
the data-parallel axis of the mesh (each block is one all-gather / reduce-scatter unit, the root holds the
embedding, final norm and output projection). Combines with tensor parallel: the TP-sliced parameters are
plain tensors that FSDP shards further along dp.

Mixed precision: with `optimization.precision: bf16` the units gather their weights in bf16 and reduce-scatter
gradients in fp32 (`MixedPrecisionPolicy`, torchtitan's default): half the all-gather traffic and no
unsharded fp32 weights during compute, while the sharded fp32 master weights and the fp32 reduction keep the
update exact. Gradients are reduce-scattered after every micro-batch (FSDP2's default): holding them
unsharded across accumulation steps would cost a full fp32 gradient per rank, which is what ZeRO-3 removes.
`seqtrain plan` counts the same (`seqtrain_operator.planner.memory`).

Checkpoints: the layout-independent tree of `seqtrain.checkpoint.dcp_format` (DTensor shards by single-process names),
which any engine, data-parallel size and tensor/pipeline degree resumes. With tensor parallel each rank's piece is a
dp chunk of its tp slice, recorded as such on a (tp, dp) mesh (`seqtrain.engine.global_state`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from seqtrain.data import Batch
from seqtrain.engine.base import Engine, StepStats
from seqtrain.engine.global_state import GlobalState
from seqtrain.engine.in_backward import StepInBackward, blocker
from seqtrain.models.loss import CausalLMLoss
from seqtrain.models.materialize import materialize
from seqtrain.parallel.grads import clip_grad_norm
from seqtrain.parallel.tensor import tp_param_names, tp_shard_dims
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16: gather in bf16, reduce in fp32. fp32 and fp16 keep fp32 everywhere (fp16 relies on autocast and the
    loss scaler, which unscale fp32 gradients)."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


class FSDPEngine(Engine):
    name = "fsdp2"

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        self.tp_names = tp_param_names(model)
        sharded = CausalLMLoss(model)
        self.sharding = ctx.distributed and ctx.dp_size > 1
        self.mp_policy = mixed_precision_policy(job.spec.optimization.precision)
        units = list(getattr(model, "blocks", None) or getattr(model, "layers", []))
        if self.sharding:
            mesh = ctx.mesh["dp"]
            for unit in units:
                fully_shard(unit, mesh=mesh, mp_policy=self.mp_policy)
            # The root is the loss wrapper, so the (tied) output projection runs inside an FSDP forward.
            fully_shard(sharded, mesh=mesh, mp_policy=self.mp_policy)
        # Built on meta (Trainer.setup leaves it so): allocate only this rank's shards and fill them with the single
        # process's values, so no rank ever holds the whole model (torchtitan's order: shard, then initialise).
        if any(p.device.type == "meta" for p in model.parameters()):
            materialize(model, ctx.device)
        super().__init__(model, job, ctx)  # the optimizer now sees the sharded (DTensor) parameters
        self.loss_module = sharded
        self.grad_clip = job.spec.training.grad_clip
        self._shard_trust_ratios(self.tp_names)
        # SGD without clipping: each block's shard is updated as soon as its gradient is reduce-scattered, so the
        # rank never holds its whole gradient shard (seqtrain.engine.in_backward says when that is exact)
        why_not = blocker(job, ctx.device, ctx.tp_size) if self.sharding else "one data-parallel rank"
        self.in_backward = StepInBackward(model, units, self.optimizer, ctx) if why_not is None else None
        if ctx.tp_size > 1:  # the TP slices (FSDP2 DTensors over dp when it shards) as parts of the full tensors
            self.global_state = GlobalState(model, lambda name: name, tp_shard_dims(model), ctx.mesh["tp"],
                                            dp_mesh=ctx.mesh["dp"] if self.sharding else None, root=ctx.mesh)

    def step(self, micro_batches: list[Batch]) -> StepStats:
        # every micro-batch reduce-scatters into the sharded fp32 gradient (no set_requires_gradient_sync(False):
        # that would keep a full unsharded gradient alive across the accumulation steps)
        armed = self.in_backward is not None and len(micro_batches) == 1  # accumulation: the step after backward
        if armed and not self.in_backward.announced and self.ctx.is_main:
            self.in_backward.announced = True
            print("FSDP2: the optimizer steps each block's shard in backward, once its gradient is reduce-scattered",
                  flush=True)
        with self.in_backward.armed() if armed else contextlib.nullcontext():
            return self._accumulate(micro_batches, lambda b: self.loss_module(b.tokens, b.targets, b.doc_ids),
                                    lambda last: contextlib.nullcontext())

    def _clip(self) -> torch.Tensor:
        if self.in_backward is not None and self.in_backward.active:
            return self.in_backward.global_norm()  # the blocks' gradients are gone: their norms were kept
        return clip_grad_norm(self.model, self.grad_clip, self.ctx, self.tp_names)
