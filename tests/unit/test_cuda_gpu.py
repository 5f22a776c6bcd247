"""What only a GPU shows of the CUDA path's fixes (their CPU halves are in tests/unit/test_cuda_fixes.py): which
SDPA kernel fp32 grouped-query attention runs, flex_attention for packed documents, compiled blocks that do not
recompile per batch, foreach gradient clipping on CUDA, and the autotuned Triton attention.
Collected by `seqtrain bench gpu` (its tests part) on the lent machine, where kopf and kubernetes are absent."""

from __future__ import annotations

import pytest
import torch

from seqtrain.benchmarks.gpu import attention_backends
from seqtrain.models import build_model, layers
from seqtrain.models.compile import compile_report, maybe_compile
from seqtrain.spec.model import ModelSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = ModelSpec(arch="gpt", vocab_size=256, dim=256, layers=2, heads=8, kv_heads=2, ffn_dim=512, max_seq_len=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_query_attention_never_runs_the_math_kernel(dtype) -> None:
    q = torch.randn(2, 8, 512, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, 512, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))

    def step() -> None:
        layers.attention(q, k, v).float().sum().backward()

    ran = attention_backends(step)
    assert ran and "math" not in ran, ran


def test_packed_documents_run_flex_attention_with_one_mask_per_batch(monkeypatch) -> None:
    torch.manual_seed(0)
    model = build_model(SPEC).cuda()
    built = []
    real = layers.doc_block_mask
    monkeypatch.setattr(layers, "doc_block_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    tokens = torch.randint(0, 256, (2, 512), device="cuda")
    doc_ids = (torch.arange(512, device="cuda") // 100).expand(2, 512)
    with torch.autocast("cuda", torch.bfloat16):
        ran = attention_backends(lambda: model(tokens, doc_ids).float().sum().backward())
    assert layers.use_flex(tokens) and built == [1]
    assert not (set(ran) & {"math", "efficient", "flash"}), ran  # no SDPA with a dense document mask


def test_compiled_blocks_do_not_recompile_for_each_batch_of_documents() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(SPEC).cuda()
    maybe_compile(model, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = []
    for _ in range(3):
        tokens = torch.randint(0, 256, (2, 512), device="cuda", generator=gen)
        cuts = torch.randint(1, 6, (2, 512), device="cuda", generator=gen).eq(1).cumsum(1)  # new documents
        with torch.autocast("cuda", torch.bfloat16):
            model(tokens, cuts).float().sum().backward()
        counts.append(compile_report(model))
    assert counts[-1]["compiled_blocks"] == SPEC.layers and counts[-1]["failures"] == 0
    assert counts[-1]["recompiles"] == counts[0]["recompiles"], counts  # batches 2 and 3 reuse the graphs


def test_clip_grad_norm_matches_torch_on_cuda() -> None:
    from seqtrain.parallel.grads import clip_grad_norm
    from seqtrain.runtime.dist import DistContext

    torch.manual_seed(0)
    model = build_model(SPEC).cuda()
    model(torch.randint(0, 256, (2, 64), device="cuda")).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm(model, 0.05, DistContext(device=torch.device("cuda")))
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    torch.testing.assert_close(norm.float(), want, rtol=1e-5, atol=0)


def test_triton_attention_autotunes_and_stays_accurate() -> None:
    import seqtrain.kernels as K
    from seqtrain.kernels.ops import attention as ops

    q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = K.attention(q, k, v, causal=True)
    out.float().sum().backward()
    tuned = ops._tuned()
    assert all(tuned[kind].best_config is not None for kind in ("fwd", "dkdv", "dq"))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                           enable_gqa=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
