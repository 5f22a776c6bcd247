"""linear_scan: the Triton parallel scan and the PyTorch reference against a sequential float64 loop."""

from __future__ import annotations

import pytest
import torch
from _kernel_checks import DTYPE_IDS, DTYPES, assert_accurate

import seqtrain.kernels as K
from seqtrain.kernels import accuracy


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("batch", "seq", "dim", "h0"), [
    (1, 1, 1, False),
    (2, 3, 13, True),
    (3, 45, 13, False),
    (1, 70, 20, True),  # several time tiles and feature tiles (CPU tiles are 32 x 16): both carries
], ids=str)
def test_linear_scan_matches_sequential_float64(batch, seq, dim, h0, dtype, device):
    assert_accurate("linear_scan", dtype, device, batch=batch, seq=seq, dim=dim, h0=h0)


@pytest.mark.slow
def test_linear_scan_long_sequence(device):
    assert_accurate("linear_scan", torch.float32, device, batch=1, seq=300, dim=5, h0=True)


@pytest.mark.parametrize("seq", [1, 2, 7, 64, 65])
def test_reference_scan_is_exact_without_a_time_loop(seq):
    # The reference (Hillis-Steele, log2(seq) steps) against the step-by-step loop, with gradients.
    args, _, grads = accuracy.make_inputs("linear_scan", "cpu", 1, batch=2, seq=seq, dim=3, h0=True)
    out_ref, g_ref = accuracy.run_with_grads(K.reference.linear_scan, args, grads, 1.0)
    out_loop, g_loop = accuracy.run_with_grads(accuracy.scan_loop, args, grads, 1.0)
    torch.testing.assert_close(out_ref, out_loop, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_ref, g_loop, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_qrnn_fo_pooling_matches_its_definition(device):
    # QRNN fo-pooling: c_t = f_t * c_{t-1} + (1 - f_t) * z_t.
    torch.manual_seed(0)
    f = torch.sigmoid(torch.randn(2, 9, 6, device=device))
    z = torch.tanh(torch.randn(2, 9, 6, device=device))
    c = K.linear_scan(f, (1 - f) * z)
    expected = accuracy.scan_loop(f.double(), ((1 - f) * z).double())
    torch.testing.assert_close(c.double(), expected, rtol=1e-5, atol=1e-6)


def test_linear_scan_rejects_bad_shapes(device):
    a = torch.rand(2, 5, 3, device=device)
    with pytest.raises(ValueError, match=r"b has shape \(2, 5, 4\) but a has \(2, 5, 3\)"):
        K.linear_scan(a, torch.rand(2, 5, 4, device=device))
    with pytest.raises(ValueError, match=r"h0 must be \[batch, dim\] = \[2, 3\]"):
        K.linear_scan(a, a, torch.zeros(3, device=device))
