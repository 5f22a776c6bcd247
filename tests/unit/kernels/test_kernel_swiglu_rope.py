"""swiglu and rope: Triton forward and backward against float64, odd shapes, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from _kernel_checks import DTYPE_IDS, DTYPES, assert_accurate

import seqtrain.kernels as K


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1,), (3, 7, 33), (2, 1500)], ids=str)
def test_swiglu_matches_float64(shape, dtype, device):
    assert_accurate("swiglu", dtype, device, shape=shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("batch", "heads", "seq", "dim", "per_batch"), [
    (1, 1, 1, 2, False),
    (2, 3, 19, 10, False),
    (2, 2, 70, 64, True),  # positions restarting per packed document: cos/sin per batch row
], ids=str)
def test_rope_matches_float64(batch, heads, seq, dim, per_batch, dtype, device):
    assert_accurate("rope", dtype, device, batch=batch, heads=heads, seq=seq, dim=dim, per_batch=per_batch)


def test_rope_rejects_bad_arguments(device):
    x = torch.randn(1, 2, 5, 6, device=device)
    cos = torch.randn(5, 6, device=device)
    with pytest.raises(ValueError, match="head_dim must be even"):
        K.rope(torch.randn(1, 2, 5, 7, device=device), torch.randn(5, 7, device=device), torch.randn(5, 7, device=device))
    with pytest.raises(ValueError, match=r"cos/sin must be \[seq, head_dim\]"):
        K.rope(x, cos[:4], cos[:4])
    with pytest.raises(ValueError, match="cos.detach"):
        K.rope(x, cos.requires_grad_(), cos)
