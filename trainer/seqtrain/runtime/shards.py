"""Write a parameter's share of a full tensor: what `init_weights` needs to initialise a model that was sharded
before it held any memory (FSDP2's DTensor shards, DeepSpeed ZeRO-3 partitions) with the single process's values.

The caller draws each full tensor in a fixed order from one seeded generator (one tensor at a time on the host);
every rank draws the same and keeps only its part, so the peak is one tensor, not the model.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def full_shape(p: torch.Tensor) -> torch.Size:
    """The unsharded shape: a DTensor's is its global shape; a ZeRO-3 partitioned parameter keeps it in ds_shape."""
    ds_shape = getattr(p, "ds_shape", None)
    return torch.Size(ds_shape) if ds_shape is not None else p.shape


def holds_memory(p: torch.Tensor) -> bool:
    """False for a parameter still on the meta device (another pipeline stage's, or not materialised yet)."""
    return hasattr(p, "ds_tensor") or p.device.type != "meta"


@torch.no_grad()
def write_local(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` (a tensor of `full_shape(p)`) into `p`."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
        part = full
        for d, (n, o) in enumerate(zip(shape, offset, strict=True)):
            part = part.narrow(d, o, n)
        p.to_local().copy_(part)
    elif hasattr(p, "ds_tensor"):
        # ZeRO-3: rank r holds elements [r * n, (r + 1) * n) of the flattened parameter, zero-padded at the end
        # (DeepSpeed's partition_parameters._partition_param lays them out so).
        local = p.ds_tensor
        n = local.ds_numel
        start = n * torch.distributed.get_rank(group=p.ds_process_group)
        flat = full.reshape(-1)
        count = max(0, min(n, flat.numel() - start))
        local.zero_()
        if count:
            local.narrow(0, 0, count).copy_(flat.narrow(0, start, count))
    else:
        p.copy_(full)
