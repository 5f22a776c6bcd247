"""What the tensor-parallel checkpoint records: every sharded parameter's split dim and full size, such that the
slice grown to the full size on that dim is the single-process parameter's shape (a wrong dim or size would make
DCP read the wrong part of the full tensor on resume at another degree)."""

from __future__ import annotations

import pytest

from seqtrain.models import build_model
from seqtrain.parallel.tensor import apply_tensor_parallel, tp_param_names, tp_shard_dims
from seqtrain.spec.model import ModelSpec

SPEC = ModelSpec(arch="gpt", vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=96, max_seq_len=64)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("rank", [0, 1])
def test_every_sharded_parameter_records_its_place_in_the_full_tensor(tied: bool, rank: int):
    spec = SPEC.model_copy(update={"tie_embeddings": tied})
    full = {n: tuple(p.shape) for n, p in build_model(spec).named_parameters()}
    model = apply_tensor_parallel(build_model(spec), rank, 2, None)
    dims = tp_shard_dims(model)
    assert set(dims) == tp_param_names(model)  # nothing sharded goes unrecorded
    assert ("lm_head.weight" in dims) is not tied
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if name in dims:
            dim, size = dims[name]
            assert shape[dim] * 2 == size
            shape[dim] = size
        assert tuple(shape) == full[name], name


@pytest.mark.parametrize(("rows", "dp"), [(6, 2), (5, 3), (3, 4)])  # even, uneven, and a rank with no rows
@pytest.mark.parametrize("dim", [0, 1])  # column-parallel / vocabulary rows, row-parallel columns
def test_fsdp2_over_tensor_parallel_records_each_piece_where_fsdp2_took_it_from(rows: int, dp: int, dim: int):
    """FSDP2 shards each rank's tp slice again along dim 0 over dp (torch.chunk's sizes); the checkpoint must record
    that piece at its offset in the full tensor, for every rank of a dp x tp2 mesh, and give the load back FSDP2's
    own DTensor over the same storage."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from seqtrain.engine.global_state import GlobalState

    tp, cols = 2, 4
    full_shape = [rows * tp, cols] if dim == 0 else [rows, cols * tp]
    full = torch.arange(full_shape[0] * full_shape[1], dtype=torch.float32).reshape(full_shape)
    grid = torch.arange(dp * tp).reshape(dp, 1, tp)  # seqtrain.parallel.mesh's (dp, pp, tp) order
    for rank in range(dp * tp):
        d, t = divmod(rank, tp)

        def mesh(ranks: torch.Tensor, names: tuple[str, ...], r: int = rank) -> DeviceMesh:
            return DeviceMesh("cpu", ranks, mesh_dim_names=names, _init_backend=False, _rank=r)

        root, dp_mesh, tp_mesh = mesh(grid, ("dp", "pp", "tp")), mesh(grid[:, 0, t], ("dp",)), mesh(grid[d, 0], ("tp",))
        tp_slice = full.chunk(tp, dim=dim)[t]
        chunks = tp_slice.chunk(dp, dim=0)
        local = chunks[d].clone() if d < len(chunks) else tp_slice[:0].clone()
        shard = DTensor.from_local(local, dp_mesh, [Shard(0)], run_check=False, shape=tp_slice.shape,
                                   stride=tp_slice.stride())
        owner = nn.Module()
        owner.weight = nn.Parameter(torch.empty(tp_slice.shape))
        state = GlobalState(owner, lambda name: name, {"weight": (dim, full_shape[dim])}, tp_mesh, dp_mesh, root)
        tree = state.to_global({"model": {"weight": shard}, "optim": {"state.weight.exp_avg": shard}})
        saved = tree["model"]["weight"]
        assert list(saved.shape) == full_shape
        size, offset = compute_local_shape_and_global_offset(saved.shape, saved.device_mesh, saved.placements)
        assert tuple(size) == tuple(local.shape), rank
        where = full[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]
        assert torch.equal(where, local), (rank, offset)
        back = state.to_local(tree)
        for value in (back["model"]["weight"], back["optim"]["state.weight.exp_avg"]):
            assert value.device_mesh is dp_mesh and value.placements == (Shard(0),) and value.shape == tp_slice.shape
            assert value.to_local().data_ptr() == local.data_ptr()
