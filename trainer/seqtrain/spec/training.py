"""`spec.training`: how long, with which batch, optimizer and schedule."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from seqtrain.spec.base import MAX_STEPS, SpecModel


class OptimizerSpec(SpecModel):
    name: Literal["adamw", "lamb", "lars", "adafactor", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(3e-4, gt=0, le=100, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam-family betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, le=1, description="Adam-family epsilon.")
    weight_decay: float = Field(0.1, ge=0, le=10, description="Decoupled weight decay; never applied to norms, biases and embeddings' scales.")
    momentum: float = Field(0.9, ge=0, lt=1, description="Momentum for sgd / lars.")
    embedding_lr_scale: float = Field(1.0, gt=0, le=100, description="Learning-rate multiplier for embedding parameters.")

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"each beta must be in [0, 1) (got {list(betas)}); e.g. [0.9, 0.95]")
        return betas


class ScheduleSpec(SpecModel):
    name: Literal["constant", "cosine", "linear", "wsd", "cyclic"] = Field(
        "cosine", description="constant, warmup+cosine, warmup+linear decay, warmup-stable-decay, cyclic."
    )
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear warmup steps from 0 to the peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of the peak.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of the steps spent decaying at the end.")
    cycle_steps: int = Field(1000, ge=1, le=MAX_STEPS, description="cyclic: length of one cycle in steps.")


class EarlyStoppingSpec(SpecModel):
    patience: int = Field(3, ge=1, le=1_000_000, description="Evaluations without improvement before the job stops (Succeeded).")
    min_delta: float = Field(0.0, ge=0, description="Smallest validation-loss decrease that counts as improvement.")


class EvalSpec(SpecModel):
    every: int = Field(0, ge=0, le=MAX_STEPS, description="Evaluate every N optimizer steps (0: only at the end, if batches > 0).")
    batches: int = Field(0, ge=0, le=1_000_000, description="Validation micro-batches per evaluation (0 disables evaluation).")
    early_stopping: EarlyStoppingSpec | None = Field(None, description="Stop when validation loss stops improving.")


class ProfileSpec(SpecModel):
    start_step: int = Field(1, ge=1, le=MAX_STEPS, description="First optimizer step of the captured window.")
    steps: int = Field(3, ge=1, le=1000, description="Number of steps to capture.")


MAX_MICRO_BATCH = 1_000_000


class TrainingSpec(SpecModel):
    steps: int = Field(100, ge=1, le=MAX_STEPS, description="Optimizer steps to train for.")
    global_batch_size: int = Field(
        8, ge=1, le=100_000_000, description="Sequences per optimizer step across all data-parallel ranks."
    )
    micro_batch_size: int | Literal["auto"] = Field(
        8, json_schema_extra={"x-kubernetes-int-or-string": True},
        description="Sequences per forward/backward on one rank; gradient accumulation (globalBatchSize / (this x "
        "data-parallel ranks)) fills the global batch. `auto`: the largest size that divides globalBatchSize / "
        "data-parallel ranks and fits resources.memory (or the GPU's memory) by the plan's memory estimate, "
        "confirmed by one probe step per candidate before training (stepping down when a step runs out of memory); "
        "the global batch stays as set, and the choice and its reason are printed and shown by plan and validate."
    )
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="Optimizer and its settings.")

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _micro_batch(cls, value: Any) -> Any:
        # a number of sequences, or the one word `auto`; bounds by hand: `ge` does not apply to a union with a string
        if isinstance(value, str) and value.strip() != "auto":
            raise ValueError(f"{value!r} is neither a number of sequences nor 'auto'; write e.g. 8 or auto")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value} is not a whole number of sequences; write e.g. 8 or auto")
        if isinstance(value, int | float) and not isinstance(value, bool) and not 1 <= value <= MAX_MICRO_BATCH:
            raise ValueError(f"{value} is out of range: use 1..{MAX_MICRO_BATCH} sequences, or auto")
        return value.strip() if isinstance(value, str) else value

    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="Learning-rate schedule.")
    grad_clip: float | None = Field(1.0, gt=0, le=1e6, description="Clip gradients to this global L2 norm (null: no clipping).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed for init, data order and dropout.")
    log_every: int = Field(1, ge=1, le=MAX_STEPS, description="Print progress every N steps (metrics.jsonl gets every step).")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Validation schedule.")
    profile: ProfileSpec | None = Field(None, description="Capture a torch.profiler trace for a window of steps.")
    allow_schedule_change: bool = Field(
        False, description="Resuming a checkpoint made for another training.steps recomputes the schedule for the "
        "new total; when that moves the learning rate of the next step (a finished cosine run extended jumps back "
        "towards the peak) the run refuses unless this is true. The run prints what happens either way.")
    deterministic: bool = Field(
        False, description="Use deterministic algorithms (slower; for loss-parity checks)."
    )
