"""FSDP2 (`fully_shard`): the torch-native ZeRO-3. Parameters, gradients and optimizer states are sharded over
the data-parallel axis of the mesh (each block is one all-gather / reduce-scatter unit, the root holds the
embedding, final norm and output projection). Combines with tensor parallel: the TP-sliced parameters are
plain tensors that FSDP shards further along dp.

Checkpoints use torch.distributed.checkpoint (DCP): every rank writes its shards plus global metadata, so a
checkpoint can be loaded into a different data-parallel degree (elastic resume; tested dp2 -> dp1 -> dp2).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from seqtrain.data import Batch
from seqtrain.parallel.grads import clip_grad_norm
from seqtrain.parallel.tensor import tp_param_names
from seqtrain.spec.job import SeqTrainJob
from seqtrain.train.dist import DistContext
from seqtrain.train.loss import CausalLMLoss

from .base import Engine, StepStats

SCHEDULER_FILE = "scheduler.pt"


class FSDPEngine(Engine):
    name = "fsdp2"

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        self.tp_names = tp_param_names(model)
        sharded = CausalLMLoss(model)
        self.sharding = ctx.distributed and ctx.dp_size > 1
        if self.sharding:
            mesh = ctx.mesh["dp"]
            for unit in getattr(model, "blocks", None) or getattr(model, "layers", []):
                fully_shard(unit, mesh=mesh)
            # The root is the loss wrapper, so the (tied) output projection runs inside an FSDP forward.
            fully_shard(sharded, mesh=mesh)
        super().__init__(model, job, ctx)  # the optimizer now sees the sharded (DTensor) parameters
        self.loss_module = sharded
        self.grad_clip = job.spec.training.grad_clip

    def step(self, micro_batches: list[Batch]) -> StepStats:
        dev = self.ctx.device
        batches = [b.to(dev) for b in micro_batches]
        tokens = torch.stack([b.num_targets() for b in batches]).sum().double()
        self.ctx.all_reduce(tokens, group=self.ctx.dp_group)
        # reduce-scatter averages over dp ranks; x dp_size turns the average back into the global sum
        scale = (self.ctx.dp_size / tokens.clamp(min=1)).float()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        for i, b in enumerate(batches):
            if self.sharding:  # accumulate unsharded; reduce-scatter once, on the last micro-batch
                self.loss_module.set_requires_gradient_sync(i == len(batches) - 1)
            with self.precision.autocast():
                ls = self.loss_module(b.tokens, b.targets, b.doc_ids)
            self.precision.backward(ls * scale)
            loss_sum += ls.detach().double()
        overflow = self.precision.unscale_and_check(self.model.parameters())  # fp16 only; max over all ranks
        grad_norm = clip_grad_norm(self.model, self.grad_clip, self.ctx, self.tp_names)
        skipped = overflow or not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.precision.update(skipped)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.stack([loss_sum, torch.tensor(float(sum(b.slots for b in batches)), dtype=torch.float64,
                                                     device=dev)])
        self.ctx.all_reduce(totals, group=self.ctx.dp_group)
        return StepStats(loss_sum=float(totals[0]), target_tokens=int(tokens), slots=int(totals[1]),
                         grad_norm=grad_norm, skipped=skipped, loss_scale=self.precision.loss_scale)

    # ---- checkpoints: DCP, resharded on load ---------------------------------------------------------------
    def _dcp_dir(self, directory: str) -> str:
        return os.path.join(directory, f"fsdp-tp{self.ctx.tp_rank}" if self.ctx.tp_size > 1 else "fsdp")

    def _group(self) -> Any:
        return self.ctx.dp_group if self.ctx.distributed else None

    def save(self, directory: str) -> list[str]:
        opts = StateDictOptions()
        state = {"model": get_model_state_dict(self.model, options=opts),
                 "optim": get_optimizer_state_dict(self.model, self.optimizer, options=opts)}
        path = self._dcp_dir(directory)
        dcp.save(state, checkpoint_id=path, process_group=self._group())
        files = []
        if self.ctx.dp_rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict(), "precision": self.precision.state_dict()},
                       os.path.join(directory, SCHEDULER_FILE))
            files.append(SCHEDULER_FILE)
            files += [os.path.join(os.path.basename(path), f) for f in sorted(os.listdir(path))]
        return files if self.ctx.is_main or self.ctx.dp_rank == 0 else []

    def load(self, directory: str) -> None:
        opts = StateDictOptions()
        state = {"model": get_model_state_dict(self.model, options=opts),
                 "optim": get_optimizer_state_dict(self.model, self.optimizer, options=opts)}
        path = self._dcp_dir(directory)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: not an FSDP2 checkpoint of this layout (see its meta.json)")
        dcp.load(state, checkpoint_id=path, process_group=self._group())
        set_model_state_dict(self.model, state["model"], options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=opts)
        rest = torch.load(os.path.join(directory, SCHEDULER_FILE), weights_only=False)
        self.scheduler.load_state_dict(rest["scheduler"])
        if rest.get("precision"):
            self.precision.load_state_dict(rest["precision"])
