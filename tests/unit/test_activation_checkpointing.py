"""Activation checkpointing: gradients identical with and without every policy (fp32, CPU, dropout on), less
saved-activation memory, unchanged parameter names; recurrent models grow sub-linearly in sequence length."""

from __future__ import annotations

import copy

import pytest
import torch

from seqtrain.models import build_model
from seqtrain.models.activation_checkpointing import (
    SavedActivationMeter,
    apply_activation_checkpointing,
    segments,
)
from seqtrain.spec.model import ModelSpec
from seqtrain.spec.optimization import ActivationCheckpointingSpec as AC

GPT = ModelSpec(arch="gpt", vocab_size=64, dim=32, layers=4, heads=4, kv_heads=2, ffn_dim=96, max_seq_len=64,
                dropout=0.1)


def rnn_spec(arch: str) -> ModelSpec:
    return ModelSpec(arch=arch, vocab_size=64, dim=16, layers=2, max_seq_len=256, dropout=0.1)


def grads_and_bytes(model: torch.nn.Module, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None
                    ) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(123)  # same dropout masks in every run
    meter = SavedActivationMeter(list(model.parameters()) + list(model.buffers()))
    with meter.measure():
        hidden = model(tokens, doc_ids)
    loss = (hidden @ model.output_weight.t()).logsumexp(-1).mean()
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return list(grads), meter.bytes


def stack_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Activations the recurrent stack keeps for backward (the input ids and the output, which the loss needs
    anyway, are not counted)."""
    meter = SavedActivationMeter([*model.parameters(), tokens])
    with meter.measure():
        model._run(tokens, None, None)
    return meter.bytes


@pytest.fixture(scope="module")
def gpt_reference() -> tuple[torch.nn.Module, torch.Tensor, list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = build_model(GPT)
    tokens = torch.randint(0, 64, (2, 64))
    grads, nbytes = grads_and_bytes(model, tokens)
    return model, tokens, grads, nbytes


@pytest.mark.parametrize("policy", ["full", "every", "sqrt", "selective"])
def test_gpt_policy_gives_identical_gradients_with_less_memory(gpt_reference, policy: str) -> None:
    base, tokens, ref_grads, ref_bytes = gpt_reference
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, AC(policy=policy, every=2), 64)
    grads, nbytes = grads_and_bytes(model, tokens)
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads, strict=True)), f"{policy}: gradients differ"
    assert nbytes < ref_bytes
    assert list(model.state_dict()) == list(base.state_dict()), "parameter names must not change"


def test_gpt_policies_order_by_memory(gpt_reference) -> None:
    base, tokens, _, none_bytes = gpt_reference
    saved = {}
    for policy in ("full", "every", "sqrt", "selective"):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, AC(policy=policy, every=2), 64)
        saved[policy] = grads_and_bytes(model, tokens)[1]
    # sqrt keeps 2 segment inputs of 4 blocks, full 4 block inputs; selective keeps norms and the residual
    assert saved["sqrt"] < saved["full"] < saved["selective"] < none_bytes
    assert saved["full"] < saved["every"] < none_bytes


def test_segments() -> None:
    assert segments(4, "full") == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert segments(5, "every", 2) == [(0, 1), (2, 3), (4, 5)]
    assert segments(9, "sqrt") == [(0, 3), (3, 6), (6, 9)]
    assert segments(12, "sqrt") == [(0, 4), (4, 8), (8, 12)]
    assert segments(4, "none") == []


def test_checkpointed_model_evaluates_without_grad_and_refuses_double_application(gpt_reference) -> None:
    base, tokens, _, _ = gpt_reference
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, AC(policy="sqrt"), 64)
    model.eval()
    base.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens), base(tokens))
    base.train()
    with pytest.raises(RuntimeError, match="already applied"):
        apply_activation_checkpointing(model, AC(policy="sqrt"), 64)


@pytest.mark.parametrize("arch", ["lstm", "gru", "qrnn"])
def test_rnn_time_chunks_identical_gradients_and_sublinear_memory(arch: str) -> None:
    torch.manual_seed(0)
    base = build_model(rnn_spec(arch))
    saved: dict[tuple[str, int], int] = {}
    for t in (64, 256):
        tokens = torch.randint(0, 64, (2, t))
        doc_ids = (torch.arange(t) >= t // 3).long().expand(2, t)  # two packed documents per row
        ref_grads, _ = grads_and_bytes(base, tokens, doc_ids)
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, AC(policy="full"), t)
        assert model.ac_time_chunks == round(t**0.5)
        grads, _ = grads_and_bytes(model, tokens, doc_ids)
        model.ac_checkpoint = False  # the same time chunks, no recomputation
        plain, _ = grads_and_bytes(model, tokens, doc_ids)
        assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True)), "checkpointing changed gradients"
        # Against the unchunked model (dropout off: chunks draw their masks in another order) chunking only
        # reorders float operations.
        base.drop.p = model.drop.p = 0.0
        model.ac_checkpoint = True
        for a, b in zip(grads_and_bytes(base, tokens, doc_ids)[0], grads_and_bytes(model, tokens, doc_ids)[0],
                        strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        base.drop.p = 0.1
        saved[("none", t)] = stack_bytes(base, tokens)
        saved[("ac", t)] = stack_bytes(model, tokens)
    ratio_none = saved[("none", 256)] / saved[("none", 64)]
    ratio_ac = saved[("ac", 256)] / saved[("ac", 64)]
    assert ratio_none > 3.5, "without checkpointing memory is linear in T"
    assert ratio_ac < 2.6, f"time-chunk checkpointing should grow ~sqrt(T), got x{ratio_ac:.2f} for 4x T"
    assert saved[("ac", 256)] < saved[("none", 256)] / 4


def test_compile_falls_back_to_eager_with_a_warning_without_a_backend(gpt_reference, monkeypatch) -> None:
    import seqtrain.models.compile as comp

    monkeypatch.setattr(comp.shutil, "which", lambda name: None)  # no C++ compiler for the CPU inductor
    model = copy.deepcopy(gpt_reference[0])
    with pytest.warns(UserWarning, match="optimization.compile: inductor on CPU needs a C\\+\\+ compiler"):
        line = comp.maybe_compile(model, torch.device("cpu"))
    assert "eager" in line and all(getattr(b, "_compiled_call_impl", None) is None for b in model.blocks)
    rnn = build_model(rnn_spec("lstm"))
    assert "skipped" in comp.maybe_compile(rnn, torch.device("cpu"))


def test_a_compile_failure_warns_naming_the_block_and_runs_eager(gpt_reference) -> None:
    """No global dynamo.config.suppress_errors: the failing block is named and runs eager with equal output."""
    import torch._dynamo

    import seqtrain.models.compile as comp

    def broken_backend(gm, example_inputs):  # noqa: ANN001, ANN202 - a dynamo backend's signature
        raise RuntimeError("backend exploded")

    torch._dynamo.reset()
    eager = copy.deepcopy(gpt_reference[0]).eval()
    model = copy.deepcopy(eager)
    comp.maybe_compile(model, torch.device("cpu"), backend=broken_backend)
    assert torch._dynamo.config.suppress_errors is False
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"torch.compile failed for blocks\.0 \(BackendCompilerFailed.*backend exploded"):
        out = model(tokens)
    assert torch.equal(out, eager(tokens))
    assert all(b._compiled_call_impl is None for b in model.blocks)  # every block fell back, each warned once
