"""`seqtrain bench step`: one run reports seqtrain's step, the bare model's step and their ratio, as JSON."""

from __future__ import annotations

import json

import pytest

from seqtrain.benchmarks import step


@pytest.mark.slow
def test_one_short_run_writes_both_figures_and_the_ratio(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert step.main(["--rounds", "2", "--steps", "1", "--warmup", "1", "--startup-runs", "0",
                      "--out", str(out)]) == 0
    result = json.loads(out.read_text())["step"]
    # the same block at the same size: the bare model is no smaller or larger than seqtrain's
    assert result["parameters"]["seqtrain"] == result["parameters"]["bare"] > 0
    for name in ("seqtrain", "bare", "seqtrain_engine"):
        assert result[name]["cpu_ms"] > 0 and result[name]["wall_ms"] > 0
    assert result["ratio_cpu"] == result["seqtrain"]["cpu_ms"] / result["bare"]["cpu_ms"]
    assert len(result["ratio_cpu_per_round"]) == 2
    assert "x CPU" in capsys.readouterr().out


def test_the_bare_model_learns_like_seqtrains():
    """Both steppers train (the loss falls on a fixed batch): the comparison is of two working steps."""
    for build in (step.seqtrain_model, step.bare_model):
        s = step.Stepper(build, 0)
        first = s.step()
        for _ in range(5):
            last = s.step()
        assert last < first - 0.1, build.__name__


def test_a_missing_config_is_a_one_line_error(tmp_path, capsys):
    assert step.main(["--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "o.json")]) == 2
    assert "no such file" in capsys.readouterr().err
