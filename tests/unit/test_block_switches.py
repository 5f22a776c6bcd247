"""The GPT block's family switches at the spec level: parameter counts the planner uses equal the built model's,
layouts that cannot honour a switch are refused naming it, and the default block is the one it always was."""

from __future__ import annotations

import pytest

from seqtrain.layout.costs import param_breakdown
from seqtrain.models import build_model, count_parameters
from seqtrain.spec import SpecError, parse_job
from seqtrain.spec.model import ModelSpec

SWITCHES = {
    "default": {},
    "gpt2": {"norm": "layernorm", "mlp": "gelu", "positions": "learned", "qkv_bias": True, "out_bias": True,
             "mlp_bias": True},
    "qwen3": {"qk_norm": True, "head_dim": 24, "qkv_bias": True, "out_bias": True},
    "qwen2": {"qkv_bias": True, "tie_embeddings": False},
    "mistral": {"sliding_window": 8, "mlp_bias": True},
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_the_planners_parameter_count_is_the_models(name: str) -> None:
    spec = ModelSpec(arch="gpt", vocab_size=96, dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=48, max_seq_len=40,
                     **SWITCHES[name])
    assert param_breakdown(spec).total == count_parameters(build_model(spec))


def job(model: dict, **opt: object) -> dict:
    return {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "x"}, "spec": {
        "model": {"arch": "gpt", "dim": 64, "layers": 4, "heads": 4, "ffnDim": 128, **model},
        "resources": {"processesPerReplica": 2}, "optimization": opt}}


@pytest.mark.parametrize("model,opt,path", [
    ({"norm": "layernorm"}, {"tensorParallel": 2, "sequenceParallel": True}, "spec.model.norm"),
    ({"mlp": "gelu"}, {"tensorParallel": 2, "sequenceParallel": True}, "spec.model.mlp"),
    ({"qkvBias": True}, {"tensorParallel": 2, "sequenceParallel": True}, "spec.model.qkvBias"),
    ({"positions": "learned"}, {"pipelineParallel": 2}, "spec.model.positions"),
    ({"positions": "learned", "ropeScaling": {"type": "linear", "factor": 2}}, {}, "spec.model.ropeScaling"),
])
def test_a_layout_that_cannot_honour_a_switch_is_refused_naming_it(model: dict, opt: dict, path: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_job(job(model, **opt))
    assert any(p.path == path for p in err.value.problems), err.value.problems


def test_tensor_parallel_takes_every_switch_but_learned_positions_stay_off_pipelines() -> None:
    everything = {"norm": "layernorm", "mlp": "gelu", "positions": "learned", "qkvBias": True, "outBias": True,
                  "mlpBias": True}
    parse_job(job(everything, tensorParallel=2))
    parse_job(job({"qkNorm": True, "headDim": 32, "slidingWindow": 16}, tensorParallel=2, sequenceParallel=True))


def test_switches_on_a_recurrent_model_are_refused() -> None:
    with pytest.raises(SpecError, match="spec.model.qkNorm: only applies to arch gpt"):
        parse_job({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "x"},
                   "spec": {"model": {"arch": "lstm", "qkNorm": True}}})


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "mistral"])
def test_the_kernel_dispatch_computes_the_same_block(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `use_kernels` on (the kernels' PyTorch reference here: SEQTRAIN_KERNELS=torch) the switches still hold:
    LayerNorm's kernel, no RoPE with learned positions, q/k norms, and the sliding window, which the flash kernel
    lacks, so attention falls back to the masked reference when the window hides positions."""
    import torch

    from seqtrain.models.dispatch import apply_kernels

    monkeypatch.setenv("SEQTRAIN_KERNELS", "torch")
    spec = ModelSpec(arch="gpt", vocab_size=96, dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=48, max_seq_len=40,
                     **SWITCHES[name])
    torch.manual_seed(0)
    model = build_model(spec).eval()
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    with torch.no_grad():
        want = [model(tokens), model(tokens, docs)]
        switched = apply_kernels(model, True)
        assert any(n.endswith("attn") for n in switched)
        got = [model(tokens), model(tokens, docs)]
    for w, g in zip(want, got, strict=True):
        assert (w - g).abs().max().item() < 1e-5
