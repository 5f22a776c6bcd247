"""`seqtrain bench gpu` on a machine without CUDA: every part runs as far as it can on tiny shapes and the
GPU-only figures say "skipped: no CUDA" (on a GPU machine this runs the real, minutes-long benchmark: skip)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from seqtrain.benchmarks import gpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; on a GPU run the real bench")


def test_dry_run_writes_every_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEQTRAIN_KERNELS", raising=False)
    assert gpu.main(["--out", str(tmp_path), "--parts", "tests,training,mfu"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] is True and set(summary["parts"]) == {"tests", "training", "mfu"}
    assert json.loads((tmp_path / "tests.json").read_text())["status"] == gpu.NO_CUDA
    training = json.loads((tmp_path / "training.json").read_text())
    assert training["status"] == "ok"
    for precision in ("bf16", "fp16"):
        run = training[precision]
        assert run["finite"] and len(run["losses"]) == run["steps"] and run["tokens_per_s"] > 0
    assert training["fp16"]["loss_scale"] > 0 and training["bf16"]["loss_scale"] is None
    mfu = json.loads((tmp_path / "mfu.json").read_text())
    assert mfu["status"] == "ok" and mfu["measured_peak"] == {"status": gpu.NO_CUDA}
    for ac in ("none", "full"):
        run = mfu[f"activation_checkpointing_{ac}"]
        assert run["mfu_vs_measured_peak"] == gpu.NO_CUDA and all(math.isfinite(x) for x in run["losses"])
    # the same initial weights and data: checkpointing changes memory, not the losses
    assert mfu["activation_checkpointing_none"]["losses"][0] == mfu["activation_checkpointing_full"]["losses"][0]


def test_kernels_part_runs_the_kernel_bench_on_the_interpreter(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    assert gpu.main(["--out", str(tmp_path), "--parts", "kernels"]) == 0
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert kernels["status"] == "ok" and {r["op"] for r in kernels["summary"]} == {"rms_norm", "attention"}
    assert all(r["kernel_ms"] and r["reference_ms"] for r in kernels["summary"])


def test_parts_past_the_budget_are_recorded_as_skipped(tmp_path: Path) -> None:
    assert gpu.main(["--out", str(tmp_path), "--parts", "tests,training", "--budget-s", "-1"]) == 0
    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert all(p["status"].startswith("skipped: over the") for p in parts.values())
    assert not (tmp_path / "training.json").exists()


def test_unknown_part_is_named() -> None:
    with pytest.raises(SystemExit):
        gpu.main(["--out", "/tmp/x", "--parts", "tests,gpu"])


def test_mfu_model_is_about_1_3b_parameters() -> None:
    from seqtrain.layout.costs import param_breakdown
    from seqtrain.obs.flops import token_flops

    job = gpu._job(gpu.MFU_MODEL, gpu.MFU_SEQ, 4, 1, "bf16", "none", True)
    params = param_breakdown(job.spec.model).total
    assert 1.2e9 < params < 1.45e9
    assert token_flops(job.spec.model, gpu.MFU_SEQ).training > 6 * params  # 6N plus attention


def test_runs_with_only_torch_numpy_pydantic_and_yaml(tmp_path: Path) -> None:
    """A fresh GPU machine has torch (and triton); the bench must not need the trainer's optional extras."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    script = f"""
import sys
BLOCKED = {{"deepspeed", "tensorboard", "prometheus_client", "tokenizers", "matplotlib", "psutil", "rich", "pytest",
           "hypothesis", "kopf", "kubernetes"}}
for name in BLOCKED:
    sys.modules[name] = None  # as if not installed: import raises ImportError, find_spec returns None
from seqtrain.benchmarks import gpu
sys.exit(gpu.main(["--out", {str(tmp_path)!r}, "--parts", "tests,training"]))
"""
    env = {"PYTHONPATH": f"{root / 'trainer'}:{root / 'operator'}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "training.json").read_text())["status"] == "ok"


def test_missing_packages_are_named_with_the_fix(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(gpu.REQUIRED, "no_such_module_xyz", "no-such-wheel")
    assert gpu.main(["--out", "/tmp/unused", "--parts", "tests"]) == 2
    err = capsys.readouterr().err
    assert "no-such-wheel" in err and "pip install" in err and "--no-index" in err
