"""The native engine: PyTorch DistributedDataParallel (gloo on CPU, nccl on CUDA), fp32/bf16/fp16 autocast, and
with `optimization.paramDtype: bf16` bf16 parameters and gradients over fp32 master weights
(`seqtrain.runtime.precision.MasterWeights`)."""

from __future__ import annotations

import contextlib
import warnings

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from seqtrain.data import Batch
from seqtrain.engine.base import Engine, StepStats
from seqtrain.runtime.dist import DistContext
from seqtrain.runtime.exitcodes import InvalidConfig
from seqtrain.runtime.precision import MasterWeights
from seqtrain.spec.job import SeqTrainJob


class NativeEngine(Engine):
    name = "native"

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        super().__init__(model, job, ctx)
        if job.spec.optimization.param_dtype == "bf16":
            # bf16 parameters from here on (DDP's buckets take the parameters' dtype): fp32 masters for the update
            if self.precision.name != "bf16":
                raise InvalidConfig(f"spec.optimization.paramDtype: bf16 computes in bf16, and precision "
                                    f"{job.spec.optimization.precision} runs {self.precision.name} on "
                                    f"{ctx.device.type}: set optimization.precision: bf16, or paramDtype: fp32")
            self.master = MasterWeights(model, self.optimizer)
        self.wrapped: nn.Module = self.loss_module
        if ctx.distributed and ctx.dp_size > 1:
            with warnings.catch_warnings():
                # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, but forward_sync_buffers=False
                # still broadcasts the buffers once at construction (broadcast_buffers=False does not), and 2.11 (the
                # lent GPU machine's) has no forward_sync_buffers: the one argument that means the same on both is
                # kept and only its deprecation warning is dropped, as the warning itself advises until torch has
                # init_sync_buffers.
                warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
                self.wrapped = DDP(
                    self.loss_module,
                    device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                    process_group=ctx.dp_group,
                    bucket_cap_mb=job.spec.optimization.bucket_mb,
                    # RoPE tables are buffers derived from the spec: identical on every rank, never broadcast.
                    broadcast_buffers=False,
                    gradient_as_bucket_view=True,
                )
        self.grad_clip = job.spec.training.grad_clip

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        # Gradients are all-reduced once, on the last micro-batch of the step.
        if isinstance(self.wrapped, DDP) and not last:
            return self.wrapped.no_sync()
        return contextlib.nullcontext()

    def step(self, micro_batches: list[Batch]) -> StepStats:
        return self._accumulate(micro_batches, lambda b: self.wrapped(b.tokens, b.targets, b.doc_ids),
                                self._sync_context)
