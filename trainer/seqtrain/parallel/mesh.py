"""The dp x pp x tp device mesh: process groups for every axis, stored on the `DistContext`.

Rank order is `seqtrain.layout.topology` (tensor parallel innermost), which is also DeviceMesh's row-major
order for mesh shape (dp, pp, tp): `init_device_mesh` builds the groups, FSDP2 takes the `dp` sub-mesh.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from seqtrain.layout.topology import MeshShape
from seqtrain.parallel import watchdog
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob


def mesh_shape(job: SeqTrainJob) -> MeshShape:
    opt = job.spec.optimization
    return MeshShape(dp=job.spec.dp, pp=opt.pipeline_parallel, tp=opt.tensor_parallel)


def init_mesh(ctx: DistContext, job: SeqTrainJob) -> DistContext:
    """Fill ctx's dp/tp/pp ranks, sizes and groups (every rank must call this, in the same order)."""
    shape = mesh_shape(job)
    if shape.world_size != ctx.world_size:
        raise ValueError(f"layout dp {shape.dp} x pp {shape.pp} x tp {shape.tp} != world size {ctx.world_size}")
    c = shape.coord(ctx.rank)
    ctx.dp_rank, ctx.dp_size = c.dp, shape.dp
    ctx.pp_rank, ctx.pp_size = c.pp, shape.pp
    ctx.tp_rank, ctx.tp_size = c.tp, shape.tp
    if not ctx.distributed:
        return ctx
    watchdog.start(job.spec.optimization.comm_timeout_seconds, ctx.rank)
    mesh = init_device_mesh(ctx.device.type, (shape.dp, shape.pp, shape.tp), mesh_dim_names=("dp", "pp", "tp"))
    ctx.mesh = mesh
    ctx.dp_group = mesh.get_group("dp")
    ctx.pp_group = mesh.get_group("pp")
    ctx.tp_group = mesh.get_group("tp")
    # Tied embeddings under pipeline parallel: the first and the last stage each hold a copy, and their
    # gradients are summed over this group (Megatron's "embedding group"). new_group is collective: every rank
    # creates every group, in the same order.
    ctx.embed_group = None
    if shape.pp > 1:
        for g in shape.pp_groups():
            pair = [g[0], g[-1]]
            group = dist.new_group(pair)
            if ctx.rank in pair:
                ctx.embed_group = group
    return ctx
