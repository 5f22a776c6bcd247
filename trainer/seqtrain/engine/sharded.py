"""Checkpoint files per model shard for layouts where ranks hold different parameters (tensor / pipeline
parallel): one file per (pp, tp) coordinate, written by the rank with dp index 0 (dp replicas are identical)."""

from __future__ import annotations

import os
from typing import Any

import torch

from seqtrain.checkpoint.safe_load import load_plain
from seqtrain.runtime.dist import DistContext


def shard_file(ctx: DistContext) -> str:
    return f"engine-pp{ctx.pp_rank}-tp{ctx.tp_rank}.pt"


def save_shard(ctx: DistContext, state: dict[str, Any], directory: str) -> list[str]:
    if ctx.dp_rank != 0:
        return []
    name = shard_file(ctx)
    torch.save(state, os.path.join(directory, name))
    return [name]


def load_shard(ctx: DistContext, directory: str) -> dict[str, Any]:
    path = os.path.join(directory, shard_file(ctx))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: this checkpoint was written with a different tensor/pipeline layout; "
                                "resume with the layout in its meta.json")
    return load_plain(path)  # CPU first: load_state_dict copies into the rank's device
