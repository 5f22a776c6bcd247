"""`spec.optimization`: precision, parallelism, memory savers and kernels."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

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
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Compute precision (master weights stay fp32). auto: bf16 on a CUDA GPU that supports it, "
        "else fp32 (the CPU always runs fp32).")
    param_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Storage of the trained parameters and their gradients. bf16: bf16 parameters and "
        "gradients with an fp32 master copy the optimizer updates (half the weight and gradient bytes; no cast of "
        "the weights in every forward); needs precision bf16 (or auto on a bf16 GPU) and the native DDP engine without "
        "tensor or pipeline parallel. Checkpoints hold the fp32 master weights either way.")
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
    kernels: bool | None = Field(None, description="Use seqtrain's Triton kernels. Unset: per op, where a GPU "
                                  "benchmark measured them faster (linear_scan on with CUDA), else the PyTorch "
                                  "reference; true: every op with a kernel; false: none.")
    compile: bool | Literal["auto"] = Field(
        "auto", description="Compile the transformer blocks with torch.compile where the backend is available. "
        "auto: on with CUDA, off on the CPU.")
    fused_projections: bool | Literal["auto"] = Field(
        "auto", description="Run the attention's q/k/v projections, and the SwiGLU MLP's gate/up, as one matrix "
        "multiply each on their concatenated weights. The parameters stay separate, so checkpoint, optimizer-state "
        "and HF export names do not change. auto: on, except under DeepSpeed ZeRO-3 (which gathers each layer's "
        "weights only inside that layer's own forward); LoRA-wrapped layers keep separate projections either way.")
    grad_compression: Literal["none", "bf16", "fp16"] = Field(
        "none", description="Compress data-parallel gradient all-reduce (communication hook)."
    )
    bucket_mb: int = Field(25, ge=1, le=65536, description="Gradient all-reduce bucket size in MiB.")
    comm_timeout_seconds: int = Field(
        600, ge=10, le=DAY, description="Collective timeout; on expiry every rank reports what it waited for and exits."
    )

    @model_validator(mode="after")
    def _param_dtype_fits(self) -> OptimizationSpec:
        why = param_dtype_problem(self)
        if why is not None:
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _fused_projections_fit(self) -> OptimizationSpec:
        if self.fused_projections is True and deepspeed_zero3(self):
            raise ValueError("fusedProjections: true reads the q/k/v and gate/up weights in the parent layer's "
                             "forward, where DeepSpeed ZeRO-3 has not gathered them: set fusedProjections: auto "
                             "(off there) or false, or engine: native (FSDP2 gathers whole blocks)")
        return self


def param_dtype_problem(opt: OptimizationSpec) -> str | None:
    """Why `paramDtype: bf16` cannot run with the rest of `opt`; None when it can (or it is fp32). `precision: auto`
    passes here and is checked on the rank, once the device it resolves on is known."""
    if opt.param_dtype == "fp32":
        return None
    where = "paramDtype: bf16"
    if opt.precision in ("fp32", "fp16"):
        return (f"{where} computes in bf16, and precision is {opt.precision}: set precision: bf16 (or auto), or "
                "paramDtype: fp32")
    if opt.engine == "deepspeed" or opt.zero.stage > 0:
        return (f"{where} is for the native DDP engine, and zero.stage {opt.zero.stage} (engine {opt.engine}) "
                "picks FSDP2 or DeepSpeed, which keep bf16 compute weights over fp32 masters themselves under "
                "precision bf16: set paramDtype: fp32")
    if opt.tensor_parallel > 1 or opt.pipeline_parallel > 1:
        return (f"{where} runs with data parallel only (tensorParallel {opt.tensor_parallel}, pipelineParallel "
                f"{opt.pipeline_parallel}): set paramDtype: fp32, or both degrees to 1")
    return None



AUTO_PRECISION = "auto: bf16 on a bf16-capable GPU, else fp32"


def resolve_precision(precision: str, device_type: str, bf16_supported: bool) -> str:
    """The precision a rank runs: `auto` is bf16 on a CUDA device with bf16, else fp32. The CPU resolves to fp32 so
    every CPU run keeps full-precision numerics; an explicit value is kept as written."""
    if precision != "auto":
        return precision
    return "bf16" if device_type == "cuda" and bf16_supported else "fp32"


def resolve_compile(compile_: bool | str, device_type: str) -> bool:
    """Whether the blocks are compiled: `auto` is on with CUDA (inductor's fused Triton kernels) and off on the CPU
    (compile time there buys little and every CPU test stays eager); a bool is kept as written."""
    if compile_ == "auto":
        return device_type == "cuda"
    return bool(compile_)


def deepspeed_zero3(opt: OptimizationSpec) -> bool:
    """Whether `opt` runs DeepSpeed at ZeRO stage 3 (`seqtrain.layout.rules.engine_of`: engine deepspeed, or auto
    with a stage above 0)."""
    return opt.zero.stage == 3 and opt.engine != "native"


def resolve_fused_projections(opt: OptimizationSpec) -> tuple[bool, str]:
    """(fuse q/k/v and gate/up, why) for `optimization.fusedProjections`. `auto` is on except under DeepSpeed
    ZeRO-3: its hooks gather a module's parameters when that module's own forward runs, so the attention reading
    `q.weight` would see an empty partition. FSDP2 gathers a whole block before the block's forward, so it fuses.
    Per layer, `seqtrain.models.layers.fusable` keeps LoRA-wrapped (or other non-plain) linears split."""
    if opt.fused_projections == "auto":
        if deepspeed_zero3(opt):
            return False, "off (auto: DeepSpeed ZeRO-3 gathers each linear's weights only in its own forward)"
        return True, "on (auto)"
    return bool(opt.fused_projections), "on" if opt.fused_projections else "off"


def planned_precision(precision: str, gpus: int) -> str:
    """The precision an estimate made before any device is seen assumes: `auto` is fp32 without GPUs and bf16 with
    them (every GPU seqtrain's peak table knows has bf16; the rank itself falls back to fp32 where it has none)."""
    return resolve_precision(precision, "cuda" if gpus > 0 else "cpu", True)


def describe_precision(precision: str, gpus: int) -> str:
    """`precision` for plan/validate output: what `auto` becomes where that is known before the run."""
    if precision != "auto":
        return precision
    return "fp32 (auto: no GPU)" if gpus == 0 else AUTO_PRECISION


def describe_compile(compile_: bool | str, gpus: int) -> str:
    if compile_ != "auto":
        return "on" if compile_ else "off"
    return "off (auto: no GPU)" if gpus == 0 else "auto: on with CUDA"


def auto_note(precision: str, compile_: bool | str, gpus: int, fused: str = "") -> str | None:
    """The `validate`/`plan` note for a GPU job that leaves precision, compile or fusedProjections at `auto` (None
    otherwise: on the CPU `auto` is what the CPU always ran, fp32 and eager). `fused`: what fusedProjections auto
    resolved to (`resolve_fused_projections`), empty when the job sets it. An auto that turns fusion off (ZeRO-3) is
    noted on the CPU too: it is the case a reader would not guess."""
    autos = [f"precision {AUTO_PRECISION}" if precision == "auto" else "",
             "compile auto: on with CUDA" if compile_ == "auto" else ""]
    if gpus > 0 and fused:
        autos.append(f"fusedProjections {fused}")
    elif fused.startswith("off"):
        return f"optimization: fusedProjections {fused}"
    if gpus == 0 or not any(autos):
        return None
    return "optimization: " + "; ".join(a for a in autos if a) + " (resolved on each rank's device)"
