"""`spec.optimization`: precision, parallelism, memory savers and kernels."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from seqtrain.spec.base import DAY, SpecModel


class ZeroSpec(SpecModel):
    stage: int = Field(0, ge=0, le=3, description="ZeRO stage: 0 (plain data parallel), 1, 2 or 3.")
    offload: Literal["none", "cpu"] = Field("none", description="Offload optimizer states (and parameters at stage 3) to CPU.")


class ActivationCheckpointingSpec(SpecModel):
    policy: Literal["none", "full", "every", "sqrt", "selective"] = Field(
        "none",
        description="none; full: every block; every: every k-th block; sqrt: about sqrt(L) segments; "
        "selective: keep cheap tensors, recompute attention/MLP internals.",
    )
    every: int = Field(2, ge=1, le=1024, description="k for policy: every.")
    time_chunks: int | None = Field(
        None, ge=1, le=1_000_000, description="Recurrent models: checkpoint over this many time chunks (default about sqrt(T))."
    )


class OptimizationSpec(SpecModel):
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Compute precision (master weights stay fp32).")
    engine: Literal["auto", "native", "deepspeed"] = Field(
        "auto", description="native: DDP/FSDP2; deepspeed: DeepSpeed ZeRO engine; auto: deepspeed when zero.stage > 0."
    )
    zero: ZeroSpec = Field(default_factory=ZeroSpec, description="ZeRO sharding of optimizer states, gradients, parameters.")
    tensor_parallel: int = Field(1, ge=1, le=256, description="Tensor-parallel degree (ranks that split each layer).")
    pipeline_parallel: int = Field(1, ge=1, le=1024, description="Pipeline-parallel degree (stages).")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = Field("1f1b", description="Pipeline schedule.")
    micro_batches: int | None = Field(
        None, ge=1, le=1_000_000, description="Pipeline micro-batches per step (default: 2 x pipeline stages)."
    )
    sequence_parallel: bool = Field(False, description="Shard norms/dropout along the sequence in tensor-parallel regions.")
    activation_checkpointing: ActivationCheckpointingSpec = Field(
        default_factory=ActivationCheckpointingSpec, description="Recompute activations in backward to save memory."
    )
    kernels: bool | None = Field(None, description="Use seqtrain's Triton kernels (default: off, the PyTorch "
                                  "reference, until a GPU benchmark shows them faster).")
    compile: bool = Field(False, description="Wrap the model with torch.compile where the backend is available.")
    grad_compression: Literal["none", "bf16", "fp16"] = Field(
        "none", description="Compress data-parallel gradient all-reduce (communication hook)."
    )
    bucket_mb: int = Field(25, ge=1, le=65536, description="Gradient all-reduce bucket size in MiB.")
    comm_timeout_seconds: int = Field(
        600, ge=10, le=DAY, description="Collective timeout; on expiry every rank reports what it waited for and exits."
    )
