"""The reference loss (kernels off) never materialises float32 [tokens, vocab] logits, and equals the plain
`F.cross_entropy(logits.float())` in value and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seqtrain.data import IGNORE_INDEX
from seqtrain.kernels.memory import NewTensors
from seqtrain.models.loss import chunked_linear_cross_entropy, linear_cross_entropy


def _reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logits = h.reshape(-1, h.shape[-1]) @ w.t()
    return F.cross_entropy(logits.float(), t.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def _grads(fn, h, w, t):  # type: ignore[no-untyped-def]
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, t)
    (loss * 0.37).backward()  # the engine scales the sum by 1 / tokens
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [None, 1, 7, 64], ids=str)
def test_chunked_loss_equals_the_reference_in_fp32(chunk):
    torch.manual_seed(0)
    h, w = torch.randn(3, 20, 16), torch.randn(50, 16)
    t = torch.randint(0, 50, (3, 20))
    t[0, :5] = IGNORE_INDEX
    ref = _grads(_reference, h, w, t)
    got = _grads(lambda a, b, c: chunked_linear_cross_entropy(a, b, c, chunk=chunk), h, w, t)
    for r, g in zip(ref, got, strict=True):
        assert g.dtype == r.dtype
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-5), (g - r).abs().max()


def test_no_float32_tokens_by_vocab_tensor_is_allocated():
    torch.manual_seed(0)
    tokens, hidden, vocab = 1024, 16, 512  # 1024 * 16 / 512: 32-token chunks, raised to 256
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,))
    for fn, full in ((_reference, True), (linear_cross_entropy, False)):
        with NewTensors() as rec:
            fn(h, w, t).backward()
        big = [s for s, dt in rec.seen if dt == torch.float32 and len(s) == 2 and s[0] * s[1] >= tokens * vocab]
        assert bool(big) == full, (fn.__name__, big)  # the reference does hold [tokens, vocab]: the probe works


def test_under_bf16_autocast_close_to_the_reference():
    torch.manual_seed(0)
    h, w = torch.randn(40, 32), torch.randn(70, 32)
    t = torch.randint(0, 70, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(_reference, h, w, t)
        got = _grads(chunked_linear_cross_entropy, h, w, t)
    exact = _grads(_reference, h.double(), w.double(), t)
    for r, g, e in zip(ref, got, exact, strict=True):
        assert g.dtype == r.dtype
        # no worse than the reference's own bf16 error
        assert (g.double() - e).abs().max() <= 1.5 * (r.double() - e).abs().max() + 1e-6


def test_padded_rows_are_masked_out():
    torch.manual_seed(0)
    h, w = torch.randn(30, 8), torch.randn(13, 8)
    t = torch.randint(0, 13, (30,))
    padded = torch.cat([w, torch.randn(3, 8) * 5])  # 16 rows, 3 of them padding with large logits
    ref = _grads(_reference, h, w, t)
    got = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, vocab=13), h, padded, t)
    assert torch.allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)
    assert torch.allclose(got[2][:13], ref[2], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[2][13:]) == 0  # no gradient reaches the pad rows


def test_bad_vocab_is_a_clear_error():
    with pytest.raises(ValueError, match=r"vocab 20 must be in \[1, 13\]"):
        linear_cross_entropy(torch.randn(2, 8), torch.randn(13, 8), torch.tensor([0, 1]), vocab=20)


def test_narrow_vocabulary_takes_the_plain_path_with_the_same_result():
    """vocab <= hidden: logits no larger than the hidden states, plain cross-entropy (pad rows sliced off)."""
    torch.manual_seed(0)
    h, w = torch.randn(2, 9, 32), torch.randn(24, 32)
    t = torch.randint(0, 20, (2, 9))
    ref = _grads(lambda a, b, c: chunked_linear_cross_entropy(a, b, c, vocab=20), h, w, t)
    got = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, vocab=20), h, w, t)
    for r, g in zip(ref, got, strict=True):
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-5)
    assert not got[2][20:].any()
