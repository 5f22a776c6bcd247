"""attention: flash-style Triton kernel against scaled_dot_product_attention (float64) with the
equivalent boolean mask: causal, packed documents (doc_ids), grouped-query heads, odd shapes."""

from __future__ import annotations

import pytest
import torch
from _kernel_checks import DTYPE_IDS, DTYPES, assert_accurate

import seqtrain.kernels as K

CASES = [
    # batch, heads, kv_heads, seq, head_dim, causal, docs
    (1, 1, 1, 1, 8, True, None),
    (2, 4, 2, 37, 24, True, None),
    (2, 3, 3, 37, 24, False, None),
    (2, 4, 1, 45, 16, True, "packed"),
    (2, 2, 2, 33, 40, False, "random"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "seq", "dim", "causal", "docs"), CASES, ids=str)
def test_attention_matches_sdpa_float64(batch, heads, kv_heads, seq, dim, causal, docs, dtype, device):
    assert_accurate("attention", dtype, device, batch=batch, heads=heads, kv_heads=kv_heads, seq=seq, dim=dim,
                    causal=causal, docs=docs)


@pytest.mark.slow
@pytest.mark.parametrize("docs", [None, "packed"])
def test_attention_long_sequence(docs, device):
    assert_accurate("attention", torch.float32, device, batch=1, heads=2, kv_heads=1, seq=150, dim=32,
                    causal=True, docs=docs)


def test_documents_do_not_see_each_other(device):
    # Changing document 1's values must not change document 0's outputs, and vice versa.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 16, device=device) for _ in range(3))
    doc = torch.tensor([[0] * 8 + [1] * 12], device=device)
    out = K.attention(q, k, v, causal=False, doc_ids=doc)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 8:] += 5.0
    v2[:, :, 8:] -= 3.0
    out2 = K.attention(q, k2, v2, causal=False, doc_ids=doc)
    assert torch.equal(out[:, :, :8], out2[:, :, :8])
    assert not torch.allclose(out[:, :, 8:], out2[:, :, 8:])


def test_doc_ranges_cover_every_allowed_pair(device):
    from seqtrain.kernels.ops.attention import doc_ranges

    gen = torch.Generator().manual_seed(3)
    for doc in (torch.randint(0, 4, (3, 29), generator=gen), torch.tensor([[5] * 10 + [2] * 9 + [5] * 4])):
        block = 8
        ranges = doc_ranges(doc.to(device), block).cpu()
        same = doc[:, :, None] == doc[:, None, :]
        for b in range(doc.shape[0]):
            for i in range(doc.shape[1]):
                lo, hi = ranges[b, i // block].tolist()
                allowed = same[b, i].nonzero().flatten()
                assert lo <= int(allowed.min()) and int(allowed.max()) < hi


def test_attention_rejects_bad_shapes(device):
    q = torch.randn(1, 3, 5, 8, device=device)
    kv = torch.randn(1, 2, 5, 8, device=device)
    with pytest.raises(ValueError, match=r"heads \(3\) must be a multiple of kv_heads \(2\)"):
        K.attention(q, kv, kv)
    with pytest.raises(ValueError, match=r"doc_ids must be \[batch, seq\] = \[1, 5\]"):
        K.attention(q, q, q, doc_ids=torch.zeros(1, 4, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="doc_ids must be an integer tensor"):
        K.attention(q, q, q, doc_ids=torch.zeros(1, 5, device=device))


def test_error_rule_is_defined_when_the_exact_gradient_is_zero():
    # The one-token softmax gradient is exactly 0; a float64 oracle may still return 1e-17 noise (it did on an Intel
    # Xeon) and an fp32 kernel 1e-7: a plain relative error would be 1e10. Measured on the op's scale it is tiny,
    # while an error on that scale is still caught.
    from seqtrain.kernels import accuracy

    gen = torch.Generator().manual_seed(0)
    exact_zero = torch.randn(1, 1, 1, 8, generator=gen, dtype=torch.float64) * 1e-17
    kernel = torch.randn(1, 1, 1, 8, generator=gen, dtype=torch.float64) * 1e-7
    d_v = torch.randn(1, 1, 1, 8, generator=gen, dtype=torch.float64)  # the op's other gradient, of size ~1
    floor = accuracy.SCALE_FLOOR * float(d_v.norm())
    assert accuracy.rel_err(kernel, exact_zero) > 1e6  # the old rule: noise divided by noise
    assert accuracy.rel_err(kernel, exact_zero, floor) < accuracy.FP32_REL_TOL
    assert accuracy.rel_err(exact_zero + 1e-3 * d_v, exact_zero, floor) > accuracy.FP32_REL_TOL
    assert accuracy.rel_err(d_v * (1 + 1e-4), d_v, floor) == pytest.approx(1e-4)  # relative where not ~0
