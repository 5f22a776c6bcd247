"""Flash attention with rectangular tiles, as the CUDA autotuner picks them: the free tile (keys of the forward and
dq kernels, queries of dk/dv) differs from the tile the document ranges are keyed by. Run on Triton's interpreter
on the CPU (natively on CUDA the autotuner chooses among `autotune_configs`)."""

from __future__ import annotations

import pytest
import torch
from _kernel_checks import assert_accurate

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's tiles; CUDA autotunes")


@pytest.mark.parametrize("tiles", [(16, 32), (32, 16), (16, 64)], ids=lambda t: f"fixed{t[0]}-free{t[1]}")
@pytest.mark.parametrize("docs", [None, "packed"])
def test_rectangular_tiles_stay_exact(tiles, docs, monkeypatch, device):
    from seqtrain.kernels.ops import attention as ops

    monkeypatch.setattr(ops, "INTERPRET_TILES", tiles)
    # a sequence that is no multiple of either tile, grouped heads, causal: every masking edge at once
    assert_accurate("attention", torch.float32, device, batch=2, heads=4, kv_heads=2, seq=77, dim=32, causal=True,
                    docs=docs)


def test_cuda_autotunes_the_free_tile_warps_and_stages():
    from seqtrain.kernels.ops import attention as ops

    for free in ("BLOCK_N", "BLOCK_M"):
        configs = ops.autotune_configs(free)
        assert len(configs) > 1
        assert {tuple(c.kwargs) for c in configs} == {(free,)}  # the range tile is never tuned
        assert len({(c.kwargs[free], c.num_warps, c.num_stages) for c in configs}) == len(configs)
