"""TensorBoard event files under `<workdir>/tensorboard/` (rank 0): `tensorboard --logdir <workdir>/tensorboard`.

Tags: train/loss, train/lr, train/grad_norm, grad_norm/<layer group> (embed, blocks.<i> or layers.<i>, norm,
lm_head), train/loss_scale (fp16), perf/tokens_per_s, perf/step_time_s, perf/model_tflops, perf/mfu, perf/hfu,
memory/peak_mb, val/loss, val/perplexity, val/bits_per_byte. A resumed run purges events past the resumed step,
so the curves show each step once.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch

from seqtrain.runtime.callbacks import BaseCallback

if TYPE_CHECKING:
    from seqtrain.train.loop import Trainer

TB_DIR = "tensorboard"

STEP_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "model_tflops": "perf/model_tflops",
    "mfu": "perf/mfu",
    "hfu": "perf/hfu",
    "mem_peak_mb": "memory/peak_mb",
}
EVAL_TAGS = {"val_loss": "val/loss", "val_perplexity": "val/perplexity", "val_bpb": "val/bits_per_byte"}


def layer_group(param_name: str) -> str:
    """'blocks.3.attn.q.weight' -> 'blocks.3'; 'embed.weight' -> 'embed'."""
    parts = param_name.split(".")
    if len(parts) > 2 and parts[0] in ("blocks", "layers") and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


class GroupGradNorms:
    """Per-layer-group gradient norms, read in an optimizer step pre-hook (the engine clears gradients before
    the loop's callbacks run). Norms are taken after clipping and rescaled to pre-clip values with the global
    norm the step reports (clipping scales every gradient by the same factor). Kept as tensors: no host sync
    inside the step."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.groups: dict[str, list[torch.nn.Parameter]] = {}
        seen: set[int] = set()
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.groups.setdefault(layer_group(name), []).append(p)
        self.armed = False
        self.norms: dict[str, torch.Tensor] | None = None
        self.handle = optimizer.register_step_pre_hook(self._hook) if hasattr(optimizer, "register_step_pre_hook") else None

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.armed:
            return
        norms: dict[str, torch.Tensor] = {}
        for group, params in self.groups.items():
            grads = [p.grad for p in params if p.grad is not None]
            if not grads or any(type(g).__name__ == "DTensor" for g in grads):
                continue  # sharded gradients: a local norm would be wrong, so report none
            norms[group] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        self.norms = norms or None

    def take(self, global_norm: float | None) -> dict[str, float]:
        """The norms of the step just taken, rescaled to before clipping; empty when none were captured."""
        norms, self.norms = self.norms, None
        if not norms:
            return {}
        values = {k: float(v) for k, v in norms.items()}
        clipped_global = math.sqrt(sum(v * v for v in values.values()))
        scale = 1.0
        if global_norm is not None and math.isfinite(global_norm) and clipped_global > 0:
            scale = max(1.0, global_norm / clipped_global)  # clipping only ever shrinks
        return {k: v * scale for k, v in values.items()}

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()


class TensorBoard(BaseCallback):
    def __init__(self, trainer: Trainer, every: int | None = None) -> None:
        self.every = every or trainer.spec.training.log_every
        self.logdir = os.path.join(trainer.runtime.workdir, TB_DIR)
        self.writer: Any = None
        self.grads: GroupGradNorms | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events a previous attempt wrote past the resumed step are hidden, as in metrics.jsonl
        self.writer = SummaryWriter(self.logdir, purge_step=trainer.step + 1 if trainer.step else None)
        optimizer = getattr(trainer.engine, "optimizer", None)
        if optimizer is not None:
            self.grads = GroupGradNorms(getattr(trainer.engine, "state_module", trainer.model), optimizer)
            self.grads.armed = (trainer.step + 1) % self.every == 0

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            return
        logged = step % self.every == 0 or step == trainer.total_steps
        if self.grads is not None:
            norms = self.grads.take(metrics.get("grad_norm"))
            if logged:
                for group, value in norms.items():
                    self.writer.add_scalar(f"grad_norm/{group}", value, step)
            self.grads.armed = (step + 1) % self.every == 0 or step + 1 == trainer.total_steps
        if logged:
            for key, tag in STEP_TAGS.items():
                value = metrics.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(tag, value, step)

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, tag in EVAL_TAGS.items():
            if isinstance(metrics.get(key), (int, float)):
                self.writer.add_scalar(tag, metrics[key], step)
        self.writer.flush()

    def on_train_end(self, trainer: Trainer, reason: str) -> None:
        if self.grads is not None:
            self.grads.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
