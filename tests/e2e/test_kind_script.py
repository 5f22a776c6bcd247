"""The kind end-to-end script is not run here (no Docker/kind); it is checked statically instead."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "e2e" / "kind-e2e.sh"


@pytest.mark.slow
def test_script_parses_and_is_wired_into_make():
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "bash tests/e2e/kind-e2e.sh" in (ROOT / "Makefile").read_text()
    assert SCRIPT.stat().st_mode & 0o111, "the script is executable"


@pytest.mark.slow
def test_shellcheck_clean():
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed")
    out = subprocess.run(["shellcheck", "-S", "warning", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout


def test_script_covers_the_issue_steps():
    text = SCRIPT.read_text()
    for step in ("kind create cluster", "role: worker", "make images", "make -s print-images",
                 "kind load docker-image", "helm upgrade --install seqtrain charts/seqtrain", "examples/k8s-cpu.yaml",
                 "wait_phase cpu-demo Succeeded", "delete \"$victim\"", "wait_phase cpu-recover Succeeded",
                 "nvidia.com/gpu", "--subresource=status", "trap cleanup EXIT"):
        assert step in text, step
    assert text.count("role: worker") == 2  # one control plane, two workers
    # every wait has a deadline
    assert "deadline" in text and "sleep" in text


def test_example_used_by_the_script_is_valid_and_fits_kind():
    from seqtrain.spec import load_job_file

    job = load_job_file(str(ROOT / "examples" / "k8s-cpu.yaml"))
    assert job.spec.resources.gpus == 0 and job.spec.checkpoint.pvc == "seqtrain-ckpt"
    from seqtrain.spec.job import DEFAULT_IMAGE

    # the default image, which `make images` builds and the script loads
    assert "image" not in yaml.safe_load((ROOT / "examples" / "k8s-cpu.yaml").read_text())["spec"]
    assert job.spec.image == DEFAULT_IMAGE
    assert job.spec.checkpoint.interval_steps < 15  # the pod is deleted after step 15: a checkpoint exists
    values = yaml.safe_load((ROOT / "charts" / "seqtrain" / "values.yaml").read_text())
    assert "fullnameOverride" in values  # the script sets it
