"""Export to Hugging Face: transformers' LlamaForCausalLM gives seqtrain's logits (CPU, fp32).

Tolerance 1e-4 absolute on logits of a 2-4 layer model with random weights: the two implementations do the same
fp32 arithmetic in a different order (fused SDPA vs eager, RMSNorm association), measured below 1e-5; a wrong
mapping (swapped k/v, untransposed RoPE halves, a missing norm weight, wrong theta or GQA grouping) moves logits
by 1e-2 or more.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from seqtrain.export.weights import Weights, WeightsError, check_shapes, load_source
from seqtrain.export.writer import export
from seqtrain.models import build_model
from seqtrain.spec.model import ModelSpec

os.environ["HF_HUB_OFFLINE"] = "1"  # transformers must only ever read local folders
transformers = pytest.importorskip("transformers")

TOL = 1e-4


def gpt_spec(tie: bool, kv_heads: int, vocab_size: int = 96, **kw) -> ModelSpec:
    return ModelSpec(arch="gpt", vocab_size=vocab_size, dim=64, layers=3, heads=4, kv_heads=kv_heads, ffn_dim=176,
                     max_seq_len=64, tie_embeddings=tie, rope_theta=500.0, norm_eps=1e-6, **kw)


def random_model(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(spec).eval()
    with torch.no_grad():  # norm scales away from 1 so a lost or swapped norm weight shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def seqtrain_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens) @ model.output_weight.T


@pytest.mark.parametrize("tie,kv_heads", [(True, 4), (False, 4), (True, 2), (False, 1)],
                         ids=["tied-mha", "untied-mha", "tied-gqa2", "untied-mqa"])
def test_transformers_llama_gives_seqtrain_logits(tmp_path, tie: bool, kv_heads: int) -> None:
    spec = gpt_spec(tie, kv_heads)
    model = random_model(spec)
    out = tmp_path / "hf"
    info = export(Weights(spec=spec, state=model.state_dict(), origin="test"), str(out))
    assert info["format"] == "hf"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is tie
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, spec.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    want = seqtrain_logits(model, tokens)
    with torch.no_grad():
        got = hf_model(tokens).logits
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"max |logit diff| {diff:.2e}"
    # and back: the export loads into seqtrain again, bit-exact
    back = load_source(str(out))
    assert back.spec.model_dump() == spec.model_dump()
    again = build_model(back.spec).eval()
    again.load_state_dict(back.state, strict=True)
    assert torch.equal(seqtrain_logits(again, tokens), want)


def test_a_plain_hf_llama_folder_loads_without_seqtrain_json(tmp_path) -> None:
    spec = gpt_spec(False, 2)
    model = random_model(spec, seed=3)
    out = tmp_path / "hf"
    export(Weights(spec=spec, state=model.state_dict()), str(out))
    (out / "seqtrain.json").unlink()  # what a folder written by transformers looks like
    back = load_source(str(out))
    assert back.spec.heads == 4 and back.spec.kv_heads == 2 and back.spec.rope_theta == 500.0
    again = build_model(back.spec.model_copy(update={"max_seq_len": 64})).eval()
    again.load_state_dict(back.state, strict=True)
    tokens = torch.randint(0, 96, (1, 20))
    assert torch.equal(seqtrain_logits(again, tokens), seqtrain_logits(model, tokens))


@pytest.mark.parametrize("arch", ["lstm", "gru", "qrnn"])
def test_rnn_exports_to_seqtrain_safetensors(tmp_path, arch: str) -> None:
    spec = ModelSpec(arch=arch, vocab_size=50, dim=32, layers=2, max_seq_len=32, tie_embeddings=arch != "gru")
    model = random_model(spec)
    out = tmp_path / arch
    info = export(Weights(spec=spec, state=model.state_dict()), str(out), fmt="hf")
    assert info["format"] == "seqtrain"  # no Hugging Face equivalent
    assert json.loads((out / "config.json").read_text())["model_type"] == f"seqtrain-{arch}"
    back = load_source(str(out))
    again = build_model(back.spec).eval()
    again.load_state_dict(back.state, strict=True)
    tokens = torch.randint(0, 50, (2, 16))
    assert torch.equal(seqtrain_logits(again, tokens), seqtrain_logits(model, tokens))


def test_shape_mismatch_names_the_tensor() -> None:
    small = random_model(gpt_spec(True, 4))
    other = build_model(gpt_spec(True, 2))
    with pytest.raises(WeightsError, match=r"blocks\.0\.attn\.k\.weight: \(64, 64\) in src but the model has \(32, 64\)"):
        check_shapes(small.state_dict(), other, "src")


def test_export_of_a_folder_that_is_no_model_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(WeightsError, match="neither a run folder"):
        load_source(str(tmp_path))


# ---- model.init: validation against the weights' description (torch-free), load-time shape errors ----------
def _job(model: dict):  # noqa: ANN202
    from seqtrain.spec import parse_job

    return parse_job({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "t"},
                      "spec": {"model": model, "data": {"seqLen": 32}}})


def test_model_init_takes_arch_and_dims_from_the_weights(tmp_path) -> None:
    from seqtrain.spec import resolve

    spec = gpt_spec(False, 2, 256)
    export(Weights(spec=spec, state=random_model(spec).state_dict()), str(tmp_path / "m"))
    m = resolve(_job({"init": str(tmp_path / "m"), "preset": "mini"})).spec.model
    assert (m.arch, m.dim, m.layers, m.heads, m.kv_heads, m.ffn_dim, m.vocab_size) == ("gpt", 64, 3, 4, 2, 176, 256)
    assert m.tie_embeddings is False and m.rope_theta == 500.0 and m.max_seq_len == 32


def test_model_init_shape_mismatch_fails_validation_naming_the_tensor(tmp_path) -> None:
    from seqtrain.spec import SpecError

    spec = gpt_spec(True, 2, 256)
    export(Weights(spec=spec, state=random_model(spec).state_dict()), str(tmp_path / "m"))
    with pytest.raises(SpecError) as err:
        _job({"init": str(tmp_path / "m"), "kvHeads": 4, "dim": 64})
    text = "\n".join(map(str, err.value.problems))
    assert "spec.model.kvHeads: 4 does not fit the weights" in text
    assert "blocks.0.attn.k.weight is [32, 64]" in text and "set it to 2" in text
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="spec.model.init: .* holds no model description"):
        _job({"init": str(tmp_path / "empty")})
    _job({"init": str(tmp_path / "not-yet")})  # written later (or only in the pods): the trainer checks at load


def test_model_init_shape_mismatch_at_load_names_the_tensor(tmp_path) -> None:
    from seqtrain.export.init import load_initial_weights

    spec = gpt_spec(True, 2, 256)
    export(Weights(spec=spec, state=random_model(spec).state_dict()), str(tmp_path / "m"))
    (tmp_path / "m" / "seqtrain.json").unlink()  # a folder validation cannot describe ...
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')  # ... wrongly
    model = build_model(gpt_spec(True, 4, 256))
    with pytest.raises(WeightsError):
        load_initial_weights(model, str(tmp_path / "m"))
    export(Weights(spec=spec, state=random_model(spec).state_dict()), str(tmp_path / "ok"))
    with pytest.raises(WeightsError, match=r"blocks\.0\.attn\.k\.weight: \(32, 64\) in model.init"):
        load_initial_weights(model, str(tmp_path / "ok"))
    assert "0.1" in load_initial_weights(build_model(spec), str(tmp_path / "ok"))
