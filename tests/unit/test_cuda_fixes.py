"""The CUDA path's fixes, shown on the CPU where they can be (tests/unit/test_cuda_gpu.py has what needs a GPU):
flex_attention found in a fresh process, the packed-document block mask built once per batch outside the blocks,
grouped-query attention by copy (what fp32 on CUDA runs instead of SDPA's MATH kernel), compile failures recorded
and counted, and clip_grad_norm with a fixed number of fused operations."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqtrain.models import build_model, layers
from seqtrain.models.compile import compile_report, maybe_compile
from seqtrain.parallel.grads import clip_grad_norm
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.model import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
SPEC = ModelSpec(arch="gpt", vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=96, max_seq_len=64)


@pytest.mark.slow
def test_flex_attention_is_found_in_a_fresh_process() -> None:
    """`hasattr(torch.nn.attention, "flex_attention")` depends on whether someone imported the submodule; the
    check must import it, or packed documents on CUDA silently get a dense [B, 1, T, T] mask."""
    code = "from seqtrain.models import layers; print(layers.flex_available())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": f"{ROOT / 'trainer'}", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "True"


def test_packed_documents_build_one_block_mask_per_batch_outside_the_blocks(monkeypatch) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    model = build_model(SPEC).eval()
    tokens = torch.randint(0, 64, (2, 48))
    doc_ids = torch.tensor([[0] * 20 + [1] * 28, [0] * 5 + [1] * 30 + [2] * 13])
    with torch.no_grad():
        dense = model(tokens, doc_ids)  # the CPU path: SDPA with a boolean document mask

    built, seen = [], []
    real_mask, real_flex = layers.doc_block_mask, layers.flex_document_attention

    def counting_mask(*args, **kwargs):
        built.append(1)
        return real_mask(*args, **kwargs)

    def recording_flex(*args, **kwargs):
        seen.append(kwargs.get("block_mask"))
        return real_flex(*args, **kwargs)

    monkeypatch.setattr(layers, "use_flex", lambda q: True)  # as on CUDA
    monkeypatch.setattr(layers, "doc_block_mask", counting_mask)
    monkeypatch.setattr(layers, "flex_document_attention", recording_flex)
    monkeypatch.setitem(layers._FLEX, "fn", flex_attention)  # eager flex: the CPU compiles no kernel for it
    with torch.no_grad():
        flex = model(tokens, doc_ids)
    assert len(built) == 1, "one block mask per batch, built by the model"
    assert len(seen) == SPEC.layers and all(m is seen[0] and m is not None for m in seen)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_grouped_query_attention_by_copy_equals_enable_gqa(monkeypatch) -> None:
    """fp32 on CUDA expands kv heads (FLASH, the only kernel that takes enable_gqa, has no fp32): same values."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 40, 16, generator=gen)
    k, v = (torch.randn(2, 2, 40, 16, generator=gen) for _ in range(2))
    doc_ids = torch.tensor([[0] * 10 + [1] * 30, [0] * 40])
    shared = [layers.attention(q, k, v), layers.attention(q, k, v, doc_ids=doc_ids)]
    assert not layers.gqa_by_copy(q, k)  # the CPU keeps enable_gqa
    assert not layers.gqa_by_copy(q.bfloat16(), k.bfloat16())  # 16-bit keeps enable_gqa (FLASH) everywhere
    monkeypatch.setattr(layers, "gqa_by_copy", lambda q, k: True)
    copied = [layers.attention(q, k, v), layers.attention(q, k, v, doc_ids=doc_ids)]
    for a, b in zip(shared, copied, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_compile_failures_are_recorded_counted_and_reported() -> None:
    import torch._dynamo

    def broken_backend(gm, example_inputs):  # noqa: ANN001, ANN202 - a dynamo backend's signature
        raise RuntimeError("backend exploded")

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    reference = build_model(SPEC).eval()

    torch._dynamo.reset()
    broken = copy.deepcopy(reference)
    maybe_compile(broken, torch.device("cpu"), backend=broken_backend)
    with pytest.warns(UserWarning, match="torch.compile failed for blocks"):
        broken(tokens)
    broken(tokens)  # eager from then on: no second attempt, no second count
    report = compile_report(broken)
    assert report["blocks"] == SPEC.layers and report["compiled_blocks"] == 0
    assert report["failures"] == SPEC.layers
    assert set(report["eager_after_failure"]) == {"blocks.0", "blocks.1"}
    assert all("backend exploded" in e for e in report["eager_after_failure"].values())

    torch._dynamo.reset()
    working = copy.deepcopy(reference)
    maybe_compile(working, torch.device("cpu"), backend="eager")  # dynamo's tracing, no C++ build
    working(tokens)
    report = compile_report(working)
    assert report["compiled_blocks"] == SPEC.layers and report["failures"] == 0 and report["graphs"] >= 1
    assert report["eager_after_failure"] == {}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _model_with_grads(layers_: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(SPEC.model_copy(update={"layers": layers_}))
    model(torch.randint(0, 64, (2, 16))).square().mean().backward()
    return model


def test_clip_grad_norm_is_torchs_with_a_fixed_number_of_fused_ops() -> None:
    ctx = DistContext(device=torch.device("cpu"))
    counts = {}
    for n in (2, 8):
        model = _model_with_grads(n)
        expected = copy.deepcopy(model)
        for p, q in zip(model.parameters(), expected.parameters(), strict=True):
            q.grad = p.grad.clone()
        with _OpCounter() as counter:
            norm = clip_grad_norm(model, 0.01, ctx)
        counts[n] = counter.calls
        want = torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.01)
        torch.testing.assert_close(norm.float(), want, rtol=1e-6, atol=0)
        for p, q in zip(model.parameters(), expected.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    # 4x the parameters, the same operations: one foreach norm and one foreach scale per group, not per tensor
    assert counts[8] == counts[2], counts
