"""rms_norm and layer_norm: Triton forward and backward against float64, odd shapes, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from _kernel_checks import DTYPE_IDS, DTYPES, assert_accurate

import seqtrain.kernels as K
from seqtrain.kernels import accuracy

SHAPES = [(1, 3), (7, 37), (2, 5, 129), (3, 1000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_float64(shape, dtype, device):
    assert_accurate("rms_norm", dtype, device, shape=shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm_matches_float64(shape, dtype, device):
    assert_accurate("layer_norm", dtype, device, shape=shape)


@pytest.mark.parametrize(("affine", "bias"), [(False, False), (True, False), (False, True)])
def test_layer_norm_without_affine_parameters(affine, bias, device):
    assert_accurate("layer_norm", torch.float32, device, shape=(5, 23), affine=affine, bias=bias)


def test_norm_rejects_weight_of_wrong_size(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \(8,\)"):
        K.rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match=r"layer_norm: bias must have shape \(8,\)"):
        K.layer_norm(x, None, torch.ones(9, device=device))


def test_unwritten_output_row_is_caught(device):
    # The harness itself: launch the kernel with one program too few. The poisoned (NaN) last row
    # must make the accuracy check fail instead of passing on stale memory.
    from seqtrain.kernels import _alloc
    from seqtrain.kernels.ops import rms_norm as op

    x = torch.randn(5, 16, device=device)
    w = torch.ones(16, device=device)
    y = _alloc.empty(5, 16, dtype=torch.float32, device=device)
    rstd = _alloc.empty(5, dtype=torch.float32, device=device)
    op._rms_norm_fwd[(4,)](x, w, y, rstd, 16, 1e-6, BLOCK=16)
    ref = K.reference.rms_norm(x.double(), w.double(), 1e-6)
    assert torch.isnan(y[4]).all()
    assert not accuracy.rel_err(y, ref) <= 1.0
