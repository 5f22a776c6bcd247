"""cross_entropy and linear_cross_entropy: accuracy, PyTorch semantics, and the memory design of the
fused linear + cross entropy (no [tokens, vocab] buffer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _kernel_checks import DTYPE_IDS, DTYPES, assert_accurate

import seqtrain.kernels as K
from seqtrain.kernels.memory import LiveTensorBytes


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("rows", "vocab"), [((1,), 2), ((3, 11), 53), ((4,), 70_001)], ids=str)
def test_cross_entropy_matches_float64(rows, vocab, dtype, device):
    assert_accurate("cross_entropy", dtype, device, rows=rows, vocab=vocab)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("rows", "hidden", "vocab", "chunk_size"), [
    ((1,), 8, 5, None),
    ((3, 11), 24, 61, None),
    ((3, 11), 24, 61, 1),
    ((37,), 16, 300, 8),  # chunk does not divide the tokens
], ids=str)
def test_linear_cross_entropy_matches_float64(rows, hidden, vocab, chunk_size, dtype, device):
    assert_accurate("linear_cross_entropy", dtype, device, rows=rows, hidden=hidden, vocab=vocab,
                    chunk_size=chunk_size)


def test_all_targets_ignored_gives_nan_like_pytorch(device):
    logits = torch.randn(4, 9, device=device)
    target = torch.full((4,), -100, device=device)
    assert torch.isnan(F.cross_entropy(logits, target))
    assert torch.isnan(K.cross_entropy(logits, target))
    assert torch.isnan(K.linear_cross_entropy(torch.randn(4, 3, device=device), torch.randn(9, 3, device=device),
                                              target))


def test_custom_ignore_index(device):
    logits = torch.randn(6, 9, device=device, dtype=torch.float64).float()
    target = torch.tensor([1, 0, 0, 8, 3, 0], device=device)
    expected = F.cross_entropy(logits.double(), target, ignore_index=0)
    assert torch.allclose(K.cross_entropy(logits, target, ignore_index=0).double(), expected, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="target range is checked only for CPU tensors")
def test_out_of_range_target_is_a_clear_error(device):
    with pytest.raises(IndexError, match=r"target contains 9, outside \[0, 9\)"):
        K.cross_entropy(torch.randn(2, 9), torch.tensor([0, 9]))
    with pytest.raises(ValueError, match=r"weight must be \[vocab, hidden\]"):
        K.linear_cross_entropy(torch.randn(2, 4), torch.randn(4, 9), torch.tensor([0, 1]))


def _allocations(fn) -> tuple[int, int]:
    """(peak live bytes, largest single tensor in bytes) of torch allocations while fn runs."""
    largest = 0

    class Largest(LiveTensorBytes):
        def _track(self, storage):
            nonlocal largest
            largest = max(largest, storage.nbytes())
            super()._track(storage)

    with Largest() as mode:
        fn()
    return mode.peak, largest


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU allocation tracking; GPU memory is in the gpu tests")
def test_linear_cross_entropy_never_allocates_full_logits():
    tokens, hidden, vocab = 512, 32, 2000
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,))
    logits_bytes = tokens * vocab * 4

    def run(fn):
        def step():
            fn(h, w, t).backward()
        return _allocations(step)

    ref_peak, ref_largest = run(K.reference.linear_cross_entropy)
    peak, largest = run(K.linear_cross_entropy)
    assert ref_largest >= logits_bytes  # the reference does hold [tokens, vocab]
    assert largest < logits_bytes / 4, f"largest kernel allocation {largest} B vs logits {logits_bytes} B"
    assert peak < ref_peak / 4, f"kernel peak {peak} B vs reference peak {ref_peak} B"


def test_linear_cross_entropy_under_autocast_reports_a_float32_loss(device):
    """Like F.cross_entropy under autocast: the loss is float32, not rounded to bf16 (what metrics.jsonl shows)."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, device=device, dtype=torch.bfloat16)
    weight = torch.randn(40, 16, device=device, dtype=torch.bfloat16)
    target = torch.randint(0, 40, (2, 7), device=device)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        fused = K.linear_cross_entropy(hidden, weight, target)
        ref = F.cross_entropy((hidden @ weight.t()).reshape(-1, 40), target.reshape(-1))
    assert fused.dtype == ref.dtype == torch.float32
    exact = F.cross_entropy((hidden.double() @ weight.double().t()).reshape(-1, 40), target.reshape(-1))
    assert abs(fused.double() - exact) <= 2 * abs(ref.double() - exact) + 1e-6
