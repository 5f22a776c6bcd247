"""The fused linear + cross entropy accumulates dW in place: no [vocab, hidden] float32 temporary per chunk
(issue 38: `dw += _mm_f32(...)` allocated one per chunk), and its results are those of the float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import seqtrain.kernels as K
from seqtrain.kernels.memory import NewTensors
from seqtrain.kernels.ops.linear_cross_entropy import addmm_f32_


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch recording; the GPU path is the gpu tests'")
def test_dw_is_one_float32_buffer_accumulated_in_place():
    torch.manual_seed(0)
    tokens, hidden, vocab, chunk = 64, 16, 300, 8  # 8 chunks
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,))
    counts = []
    for size in (tokens, chunk):  # one chunk, then 8
        with NewTensors() as rec:
            loss = K.linear_cross_entropy(h, w, t, chunk_size=size)
        counts.append(sum(1 for s in rec.seen if s == ((vocab, hidden), torch.float32)))
    # dW itself (and, off CUDA, the weight widened once for dH): never one per chunk
    assert counts[1] == counts[0] <= 2, f"float32 [vocab, hidden] tensors: 1 chunk {counts[0]}, 8 chunks {counts[1]}"
    loss.backward()
    exact = F.cross_entropy(h.detach().double() @ w.detach().double().t(), t)
    assert abs(loss.double().item() - exact.item()) < 2e-2
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.cross_entropy(hd @ wd.t(), t).backward()
    assert torch.allclose(h.grad.double(), hd.grad, atol=1e-3, rtol=2e-2)
    assert torch.allclose(w.grad.double(), wd.grad, atol=1e-3, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_addmm_f32_accumulates_like_a_float32_product(dtype):
    torch.manual_seed(1)
    a, b = torch.randn(7, 5).to(dtype), torch.randn(5, 3).to(dtype)
    acc = torch.randn(7, 3)
    expected = acc + a.float() @ b.float()
    ptr = acc.data_ptr()
    addmm_f32_(acc, a, b)
    assert acc.data_ptr() == ptr and acc.dtype == torch.float32
    assert torch.allclose(acc, expected, atol=1e-5)
