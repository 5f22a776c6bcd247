"""The native engine: PyTorch DistributedDataParallel (gloo on CPU, nccl on CUDA), fp32/bf16/fp16 autocast."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from seqtrain.data import Batch
from seqtrain.spec.job import SeqTrainJob
from seqtrain.train.dist import DistContext

from .base import Engine, StepStats


class NativeEngine(Engine):
    name = "native"

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        super().__init__(model, job, ctx)
        self.wrapped: nn.Module = self.loss_module
        if ctx.distributed and ctx.dp_size > 1:
            self.wrapped = DDP(
                self.loss_module,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                process_group=ctx.dp_group,
                bucket_cap_mb=job.spec.optimization.bucket_mb,
                # RoPE tables are buffers derived from the spec: identical on every rank, no per-step broadcast.
                forward_sync_buffers=False,
                gradient_as_bucket_view=True,
            )
        self.grad_clip = job.spec.training.grad_clip

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        # Gradients are all-reduced once, on the last micro-batch of the step.
        if isinstance(self.wrapped, DDP) and not last:
            return self.wrapped.no_sync()
        return contextlib.nullcontext()

    def step(self, micro_batches: list[Batch]) -> StepStats:
        dev = self.ctx.device
        batches = [b.to(dev) for b in micro_batches]
        # The global target-token count is the loss denominator, so it is all-reduced before any backward.
        tokens = torch.stack([b.num_targets() for b in batches]).sum().double()
        self.ctx.all_reduce(tokens, group=self.ctx.dp_group)
        # DDP averages gradients over dp ranks; x dp_size turns that average back into the global sum.
        scale = (self.ctx.dp_size / tokens.clamp(min=1)).float()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        for i, b in enumerate(batches):
            with self._sync_context(last=i == len(batches) - 1):
                with self.precision.autocast():
                    ls = self.wrapped(b.tokens, b.targets, b.doc_ids)
                self.precision.backward(ls * scale)  # fp16: x loss scale, so small gradients do not underflow
            loss_sum += ls.detach().double()
        # fp16: divide the gradients by the loss scale; True if any is inf/NaN (max-reduced over ranks)
        overflow = self.precision.unscale_and_check(self.model.parameters())
        grad_norm = self._clip()
        # host sync: the update decision needs the value. Skipping keeps inf/NaN out of the weights.
        skipped = overflow or not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.precision.update(skipped)  # fp16: halve the scale after an overflow, grow after a good run
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.stack([loss_sum, torch.tensor(float(sum(b.slots for b in batches)), dtype=torch.float64,
                                                     device=dev)])
        self.ctx.all_reduce(totals, group=self.ctx.dp_group)
        return StepStats(loss_sum=float(totals[0]), target_tokens=int(tokens), slots=int(totals[1]),
                         grad_norm=grad_norm, skipped=skipped, loss_scale=self.precision.loss_scale)

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip is not None else math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
