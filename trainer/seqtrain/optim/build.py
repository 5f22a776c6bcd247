"""Optimizer with parameter groups and learning-rate schedules as pure functions of the step.

Groups: "decay" (matrices), "no_decay" (norm scales and biases: decaying them only shrinks the model's
freedom to scale activations), "embed" (embedding tables: decayed, learning rate x embeddingLrScale).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from seqtrain.optim.schedules import lr_factor  # torch-free: the local runner checks a resume with it too
from seqtrain.runtime.shards import full_shape
from seqtrain.spec.training import OptimizerSpec, ScheduleSpec


def param_groups(model: nn.Module, spec: OptimizerSpec) -> list[dict[str, Any]]:
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, embed = [], [], []
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in embed_ids:
            embed.append(p)
        elif len(full_shape(p)) < 2:  # a ZeRO-3 partitioned parameter's own shape is flat
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": spec.weight_decay, "lr": spec.lr},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0, "lr": spec.lr},
        {"name": "embed", "params": embed, "weight_decay": spec.weight_decay, "lr": spec.lr * spec.embedding_lr_scale},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    if spec.name != "adamw":
        from seqtrain.optim.optimizers import make_optimizer  # LAMB, LARS, Adafactor, SGD-momentum

        return make_optimizer(param_groups(model, spec), spec)
    groups = param_groups(model, spec)
    # fused: one CUDA kernel for the whole update instead of a loop of small ones (needs every tensor on CUDA)
    fused = all(p.is_cuda for g in groups for p in g["params"]) and any(g["params"] for g in groups)
    return torch.optim.AdamW(groups, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, fused=fused or None)


def build_scheduler(
    optimizer: torch.optim.Optimizer, spec: ScheduleSpec, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    lr_factor(0, spec, total_steps)  # fail fast on an unknown schedule name
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, spec, total_steps))
