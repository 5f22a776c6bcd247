"""`optimization.fusedProjections`: q/k/v and gate/up as one GEMM each (`seqtrain.models.layers.fused_linear`) give
the split projections' loss and gradients, keep every parameter name, are taken when on, are not taken for LoRA
adapters, and `auto` resolves off under DeepSpeed ZeRO-3 only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from seqtrain.models import build_model, layers
from seqtrain.models.dispatch import apply_fused_projections, setup_fused_projections
from seqtrain.models.loss import CausalLMLoss
from seqtrain.spec import SpecError, parse_job
from seqtrain.spec.model import LoraSpec, ModelSpec
from seqtrain.spec.optimization import OptimizationSpec, resolve_fused_projections

SWITCHES = {
    "mha": {"kv_heads": 4},
    "gqa": {"kv_heads": 2},
    "qkv-bias": {"kv_heads": 2, "qkv_bias": True, "tie_embeddings": False},  # Qwen2
    "qk-norm": {"kv_heads": 2, "qk_norm": True, "head_dim": 12, "qkv_bias": True, "out_bias": True},  # Qwen3
    "gelu": {"kv_heads": 4, "norm": "layernorm", "mlp": "gelu", "positions": "learned", "qkv_bias": True,
             "out_bias": True, "mlp_bias": True},  # GPT-2: fused q/k/v, the MLP has one projection
    "mlp-bias": {"kv_heads": 2, "mlp_bias": True, "sliding_window": 8},
}


def spec(**switches: object) -> ModelSpec:
    return ModelSpec(arch="gpt", vocab_size=96, dim=32, layers=2, heads=4, ffn_dim=48, max_seq_len=40,
                     **switches)


def pair(s: ModelSpec) -> tuple[nn.Module, nn.Module]:
    """(split, fused): the same weights from one seed."""
    torch.manual_seed(0)
    split = build_model(s)
    fused = copy.deepcopy(split)
    apply_fused_projections(fused, True)
    return split, fused


def tokens_and_targets(t: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 96, (2, t), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -100
    return tokens, targets


def loss_and_grads(model: nn.Module, doc_ids: torch.Tensor | None = None,
                   autocast: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens, targets = tokens_and_targets()
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = CausalLMLoss(model)(tokens, targets, doc_ids)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_fused_projections_give_the_split_loss_and_gradients(name: str) -> None:
    split, fused = pair(spec(**SWITCHES[name]))
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    for doc_ids in (None, docs):
        want_loss, want = loss_and_grads(split, doc_ids)
        got_loss, got = loss_and_grads(fused, doc_ids)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
        assert got.keys() == want.keys() == {n for n, _ in split.named_parameters()}
        for n in want:  # fp32 rounding of differently blocked GEMMs: at most about 2e-6 absolute here
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=5e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_bf16_autocast_gives_the_split_loss_and_gradients() -> None:
    """Under autocast the fused function casts x and the weights as autocast's linear does: bf16 GEMMs, fp32
    parameter gradients."""
    split, fused = pair(spec(**SWITCHES["qkv-bias"]))
    want_loss, want = loss_and_grads(split, autocast=True)
    got_loss, got = loss_and_grads(fused, autocast=True)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-2, atol=1e-2)
    for n in want:
        assert got[n].dtype == want[n].dtype == torch.float32
        torch.testing.assert_close(got[n], want[n], rtol=5e-2, atol=5e-3, msg=lambda m, n=n: f"{n}: {m}")


def test_the_fused_path_is_taken_when_on_and_only_then(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = layers.fused_linear

    def counting(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        calls.append(len(linears))
        return real(x, linears)

    monkeypatch.setattr(layers, "fused_linear", counting)
    split, fused = pair(spec(kv_heads=2))
    tokens, _ = tokens_and_targets()
    split(tokens)
    assert calls == []
    fused(tokens)
    assert calls == [3, 2, 3, 2]  # per block: q/k/v, then gate/up
    assert apply_fused_projections(fused, False) == (0, 4)
    calls.clear()
    fused(tokens)
    assert calls == []


@pytest.mark.parametrize("name", list(SWITCHES))
def test_parameter_names_are_unchanged(name: str) -> None:
    split, fused = pair(spec(**SWITCHES[name]))
    assert list(split.state_dict()) == list(fused.state_dict())
    assert [n for n, _ in split.named_parameters()] == [n for n, _ in fused.named_parameters()]


def test_lora_adapters_keep_the_split_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from seqtrain.models.lora import apply_lora

    lora = LoraSpec(rank=4, alpha=8, target_modules=["q", "v", "gate", "up", "down"])
    s = spec(kv_heads=2, tie_embeddings=False).model_copy(update={"lora": lora})
    torch.manual_seed(0)
    split = build_model(s)
    apply_lora(split, lora, "gpt")
    for p in split.parameters():  # adapters start at zero (B = 0): give them weight so they count
        if p.requires_grad:
            nn.init.normal_(p, std=0.1)
    fused = copy.deepcopy(split)
    assert apply_fused_projections(fused, True) == (0, 4)  # every layer has an adapter among its projections

    def refuse(*_: object) -> None:
        raise AssertionError("fused_linear ran on LoRA-wrapped projections")

    monkeypatch.setattr(layers, "fused_linear", refuse)
    want_loss, want = loss_and_grads(split)
    got_loss, got = loss_and_grads(fused)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_lora_on_some_projections_fuses_the_rest() -> None:
    from seqtrain.models.lora import apply_lora

    lora = LoraSpec(rank=4, alpha=8, target_modules=["q", "v"])
    torch.manual_seed(0)
    model = build_model(spec(kv_heads=2))
    apply_lora(model, lora, "gpt")
    assert apply_fused_projections(model, True) == (2, 4)  # the SwiGLUs fuse, the attentions stay split


def test_fusable_wants_plain_linears_with_matching_biases() -> None:
    a, b = nn.Linear(8, 4), nn.Linear(8, 2)
    assert layers.fusable((a, b))
    assert not layers.fusable((a, nn.Linear(8, 2, bias=False)))

    class Wrapped(nn.Linear):
        pass

    assert not layers.fusable((a, Wrapped(8, 2)))


def test_fused_linear_splits_by_each_weights_rows() -> None:
    """Tensor parallel leaves each column-parallel linear a slice of rows: the output splits by the local rows."""
    torch.manual_seed(0)
    lins = (nn.Linear(8, 6), nn.Linear(8, 2), nn.Linear(8, 2))
    x = torch.randn(3, 5, 8, requires_grad=True)
    got = layers.fused_linear(x, lins)
    assert [g.shape[-1] for g in got] == [6, 2, 2]
    for g, lin in zip(got, lins, strict=True):
        torch.testing.assert_close(g, lin(x), rtol=1e-6, atol=1e-6)


def test_sequence_parallels_gathered_projections_fuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gather_linears(fused=True)` (one rank: the gather and reduce-scatter are identities) equals the split path
    in forward and backward."""
    from seqtrain.parallel import sequence

    monkeypatch.setattr(sequence, "all_gather_seq", lambda x, group, size: x)
    monkeypatch.setattr(sequence, "reduce_scatter_seq", lambda x, group, size: x)
    torch.manual_seed(0)
    ws = [torch.randn(n, 8, requires_grad=True) for n in (6, 2, 2)]
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = {}
    for fused in (False, True):
        ys = sequence.gather_linears(x, None, 1, *ws, fused=fused)
        sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
        out[fused] = [*ys, x.grad.clone(), *(w.grad.clone() for w in ws)]
        for t in (x, *ws):
            t.grad = None
    for a, b in zip(out[False], out[True], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_cached_decoding_fuses_and_matches() -> None:
    from seqtrain.generate import Sampling, generate_ids

    split, fused = pair(spec(**SWITCHES["qk-norm"]))
    s = Sampling(max_new_tokens=8, temperature=0.0)
    assert list(generate_ids(fused, [1, 2, 3], s)) == list(generate_ids(split, [1, 2, 3], s))


def job(**opt: object) -> dict:
    return {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "x"}, "spec": {
        "model": {"arch": "gpt", "dim": 64, "layers": 2, "heads": 4, "ffnDim": 128},
        "resources": {"processesPerReplica": 2}, "training": {"globalBatchSize": 16}, "optimization": opt}}


@pytest.mark.parametrize("opt,on", [
    ({}, True),
    ({"zero": {"stage": 1}}, True),
    ({"zero": {"stage": 3}}, False),  # auto engine: DeepSpeed
    ({"engine": "deepspeed", "zero": {"stage": 3}}, False),
    ({"engine": "native", "zero": {"stage": 3}}, True),  # FSDP2 gathers the whole block
    ({"fusedProjections": False}, False),
    ({"fusedProjections": True, "zero": {"stage": 2}}, True),
])
def test_auto_is_on_except_under_deepspeed_zero3(opt: dict, on: bool) -> None:
    j = parse_job(job(**opt))
    enabled, why = resolve_fused_projections(j.spec.optimization)
    assert enabled is on and why.startswith("on" if on else "off")
    assert ("ZeRO-3" in why) == (opt.get("fusedProjections", "auto") == "auto" and not on)


def test_true_under_deepspeed_zero3_is_refused_naming_the_fix() -> None:
    with pytest.raises(SpecError, match="fusedProjections: auto"):
        parse_job(job(fusedProjections=True, zero={"stage": 3}))
    assert OptimizationSpec(fused_projections=True, engine="native", zero={"stage": 3}).fused_projections is True


def test_setup_switches_the_model_and_says_so() -> None:
    j = parse_job(job())
    torch.manual_seed(0)
    model = build_model(spec(kv_heads=2))
    assert setup_fused_projections(model, j) == "fused projections: on (auto)"
    assert all(m.fuse_projections for m in model.modules() if hasattr(type(m), "fuse_projections"))
    j3 = parse_job(job(zero={"stage": 3}))
    assert setup_fused_projections(model, j3).startswith("fused projections: off (auto: DeepSpeed ZeRO-3")
    assert not any(m.fuse_projections for m in model.modules() if hasattr(type(m), "fuse_projections"))


def test_plan_shows_the_resolved_value() -> None:
    from seqtrain_operator.planner.local import local_plan
    from seqtrain_operator.planner.show import plan_dict, render

    for opt, want in (({}, "on (auto)"), ({"zero": {"stage": 3}}, "off (auto: DeepSpeed ZeRO-3")):
        j = parse_job(job(**opt))
        d = plan_dict(j, local_plan(j))
        assert d["fusedProjections"].startswith(want)
        assert f"fused projections {want}" in render(d)


def test_validate_notes_an_auto_that_fuses_on_a_gpu_or_turns_fusion_off() -> None:
    from seqtrain.spec.resolve import job_notes

    def opt_notes(**opt: object) -> list[str]:
        return [n for n in job_notes(parse_job(job(**opt))) if n.startswith("optimization:")]

    gpu = job()
    gpu["spec"]["resources"] = {"gpus": 1}
    assert any("fusedProjections on (auto)" in n for n in job_notes(parse_job(gpu)))
    assert opt_notes() == []  # the CPU with nothing surprising: no note
    assert opt_notes(zero={"stage": 3}) == [
        "optimization: fusedProjections off (auto: DeepSpeed ZeRO-3 gathers each linear's weights only in its own "
        "forward)"]
    assert opt_notes(fusedProjections=False, zero={"stage": 3}) == []  # what the user set is not a derivation
