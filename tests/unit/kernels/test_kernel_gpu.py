"""GPU-only checks: realistic shapes natively on CUDA and peak memory from the CUDA allocator.
(All other kernel tests also run natively on CUDA when a GPU is present.)"""

from __future__ import annotations

import pytest
import torch
from _kernel_checks import assert_accurate

import seqtrain.kernels as K
from seqtrain.kernels.memory import peak_bytes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_realistic_shapes_are_accurate(dtype):
    assert_accurate("attention", dtype, "cuda", batch=2, heads=8, kv_heads=2, seq=1000, dim=64, causal=True,
                    docs="packed")
    assert_accurate("linear_cross_entropy", dtype, "cuda", rows=(2, 1000), hidden=512, vocab=32_003)
    assert_accurate("linear_scan", dtype, "cuda", batch=4, seq=2049, dim=300, h0=True)
    assert_accurate("rms_norm", dtype, "cuda", shape=(4, 1000, 4096))


def _train_step(fn, *args, **kwargs):
    def step():
        fn(*args, **kwargs).float().sum().backward()
    return step


def test_linear_cross_entropy_uses_a_fraction_of_the_reference_memory():
    tokens, hidden, vocab = 8192, 1024, 32_000
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    ref = peak_bytes(_train_step(K.reference.linear_cross_entropy, h, w, t), "cuda")
    ker = peak_bytes(_train_step(K.linear_cross_entropy, h, w, t), "cuda")
    assert ker < ref / 2, (ker, ref)


def test_attention_does_not_store_a_seq_by_seq_matrix():
    b, heads, seq, d = 1, 8, 4096, 64
    q, k, v = (torch.randn(b, heads, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    doc = (torch.arange(seq, device="cuda") // 1000)[None]
    ker = peak_bytes(_train_step(K.attention, q, k, v, True, doc), "cuda")
    scores_bytes = b * heads * seq * seq * 2
    assert ker < scores_bytes / 4, (ker, scores_bytes)
