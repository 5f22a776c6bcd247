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
