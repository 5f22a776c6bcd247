"""Checkpoint files per model shard, as tensor- and pipeline-parallel layouts wrote them before the DCP format
(one file per (pp, tp) coordinate, written by the rank with dp index 0): still read, on the layout that wrote them."""

from __future__ import annotations

import os
from typing import Any

from seqtrain.checkpoint.safe_load import load_plain
from seqtrain.runtime.dist import DistContext


def shard_file(ctx: DistContext) -> str:
    return f"engine-pp{ctx.pp_rank}-tp{ctx.tp_rank}.pt"


def load_shard(ctx: DistContext, directory: str) -> dict[str, Any]:
    path = os.path.join(directory, shard_file(ctx))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: this checkpoint was written with a different tensor/pipeline layout; "
                                "resume with the layout in its meta.json")
    return load_plain(path)  # CPU first: load_state_dict copies into the rank's device
