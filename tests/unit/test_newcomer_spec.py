"""Issue 42, the spec side of a newcomer's first hour: derived model fields come from what the user set (never an
unnamed preset) and say where they came from; vocabulary advice that agrees with itself."""

from __future__ import annotations

import pytest
import yaml

from seqtrain.spec import SpecError, parse_job
from seqtrain.spec.load import apply_overrides
from seqtrain.spec.presets import GPT_PRESETS
from seqtrain.spec.resolve import resolve_model, resolved_model, swiglu_hidden

BASE = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: t}
spec:
  model: {arch: gpt}
  data: {seqLen: 64}
  training: {steps: 10, globalBatchSize: 8, microBatchSize: 4}
"""


def job(**sets: object):
    return parse_job(apply_overrides(yaml.safe_load(BASE), [f"{k}={v}" for k, v in sets.items()]))


def spec_problems(**sets: object) -> dict[str, str]:
    with pytest.raises(SpecError) as exc:
        job(**sets)
    return {p.path: p.message for p in exc.value.problems}


def test_ffn_dim_is_derived_from_the_users_dim_not_the_tiny_preset() -> None:
    # nanoGPT's shakespeare_char shape, no preset named: the MLP width follows dim 128 (the mini preset's 344),
    # not the tiny preset's 176, which was meant for dim 64.
    m = resolved_model(job(**{"model.dim": 128, "model.layers": 4, "model.heads": 4}))
    assert (m.dim, m.layers, m.heads, m.kv_heads, m.ffn_dim) == (128, 4, 4, 4, 344)


def test_a_named_presets_ffn_dim_follows_an_overridden_dim() -> None:
    m = resolved_model(job(**{"model.preset": "tiny", "model.dim": 256, "model.heads": 4}))
    assert (m.dim, m.layers, m.ffn_dim) == (256, 2, swiglu_hidden(256))


@pytest.mark.parametrize("name", sorted(GPT_PRESETS))
def test_the_swiglu_rule_reproduces_every_gpt_preset(name: str) -> None:
    p = GPT_PRESETS[name]
    assert swiglu_hidden(p["dim"]) == p["ffn_dim"]


def test_no_size_set_is_the_default_preset_and_says_so() -> None:
    r = resolve_model(job())
    assert (r.model.dim, r.model.layers, r.model.ffn_dim) == (64, 2, 176)
    assert "default" in r.origin["dim"] and "tiny" in r.origin["dim"]


def test_only_dim_set_takes_layers_from_the_default_preset_and_says_so() -> None:
    r = resolve_model(job(**{"model.dim": 128}))
    assert (r.model.layers, r.model.heads, r.model.ffn_dim) == (2, 4, 344)
    assert r.origin["layers"] == "default preset tiny" and r.origin["ffn_dim"].startswith("from dim 128")


def test_heads_that_do_not_divide_the_default_dim_are_refused() -> None:
    assert "spec.model.heads" in spec_problems(**{"model.heads": 3})


def test_an_unknown_preset_is_refused() -> None:
    got = spec_problems(**{"model.preset": "huge"})
    assert "spec.model.preset" in got and "tiny" in got["spec.model.preset"]


def test_the_derivation_line_names_each_fields_origin() -> None:
    line = resolve_model(job(**{"model.dim": 128, "model.layers": 4, "model.heads": 4})).derivations()
    assert "ffnDim 344 (from dim 128" in line
    assert "dim 128 (set)" in line and "maxSeqLen 64 (data.seqLen)" in line


def test_vocab_advice_for_a_byte_model_on_prepared_byte_data_does_not_go_in_a_circle(tmp_path) -> None:
    import json

    from seqtrain.data.prepare import prepare

    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "seqtrain.json").write_text(json.dumps({"model": {
        "arch": "gpt", "vocab_size": 256, "dim": 64, "layers": 2, "heads": 4, "kv_heads": 4, "ffn_dim": 176}}))
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "prep"), progress=False)  # byte data: vocab 257 (EOD 256)
    sets = {"model.init": str(tmp_path / "exp"), "data.source": "tokens", "data.paths": f"[{tmp_path / 'prep'}]"}
    advice = [spec_problems(**sets), spec_problems(**sets, **{"model.vocabSize": 257}),
              spec_problems(**sets, **{"model.vocabSize": 256})]
    for got in advice:  # the same one message whatever vocabSize says, and it does not suggest a vocabSize
        assert list(got) == ["spec.model.init"], got
        assert "data.source text" in got["spec.model.init"] and "without model.init" in got["spec.model.init"]
    assert advice[0] == advice[1] == advice[2]


def test_validate_and_plan_print_the_derived_fields_with_their_origin(tmp_path, capsys) -> None:
    from seqtrain_operator.cli import main as cli_main

    doc = yaml.safe_load(BASE)
    doc["spec"]["model"] = {"arch": "gpt", "dim": 128, "layers": 4, "heads": 4}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    assert cli_main(["validate", str(tmp_path / "job.yaml")]) == 0
    out = capsys.readouterr().out
    assert "note: model gpt: dim 128 (set)" in out and "ffnDim 344 (from dim 128" in out
    assert cli_main(["plan", str(tmp_path / "job.yaml")]) == 0
    assert "ffnDim 344 (from dim 128" in capsys.readouterr().out
