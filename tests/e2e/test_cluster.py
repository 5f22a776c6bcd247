"""End-to-end against a real cluster (kind, via `make kind-e2e`). Skipped when no cluster with seqtrain is reachable."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import time
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.control_plane]
NS = os.environ.get("SEQTRAIN_E2E_NAMESPACE", "seqtrain-e2e")


def kubectl(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    exe = str(ROOT / ".tools/bin/kubectl") if (ROOT / ".tools/bin/kubectl").exists() else shutil.which("kubectl")
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
    return out


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if not ((ROOT / ".tools/bin/kubectl").exists() or shutil.which("kubectl")):
        pytest.skip("no kubectl: run `make tools`, then `make kind-e2e` to run these against a kind cluster")
    try:
        probe = kubectl("get", "crd", "seqtrainjobs.seqtrain.dev", "--request-timeout=5s", check=False, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.skip("no reachable Kubernetes cluster (kubectl timed out); `make kind-e2e` creates one")
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["unknown error"])[-1][:160]
        pytest.skip(f"no reachable cluster with seqtrain installed ({why}); `make kind-e2e` sets one up")
    kubectl("get", "namespace", NS)


def _status(name: str) -> dict:
    out = kubectl("-n", NS, "get", "seqtrainjob", name, "-o", "json")
    return json.loads(out.stdout).get("status", {})


def _wait(name: str, phases: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    st: dict = {}
    while time.monotonic() < deadline:
        st = _status(name)
        if st.get("phase") in phases:
            return st
        time.sleep(3)
    raise AssertionError(f"{name} not in {phases} after {timeout}s: {st}")


def test_cpu_job_succeeds_with_status_columns():
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    manifest = (ROOT / "examples/k8s-cpu.yaml").read_text().replace("name: cpu-demo", f"name: {name}")
    manifest = manifest.replace("steps: 60", "steps: 20")
    subprocess.run([shutil.which("kubectl") or str(ROOT / ".tools/bin/kubectl"), "-n", NS, "apply", "-f", "-"],
                   input=manifest, text=True, check=True, capture_output=True)
    try:
        st = _wait(name, {"Succeeded", "Failed"}, 900)
        assert st["phase"] == "Succeeded", st.get("message")
        assert st["progress"]["step"] == 20 and st["worldSize"] == 2
        cols = kubectl("-n", NS, "get", "stj", name).stdout.splitlines()[0].split()
        assert cols[:5] == ["NAME", "PHASE", "REPLICAS", "STEP", "LOSS"]
    finally:
        kubectl("-n", NS, "delete", "stj", name, "--wait=true", "--timeout=120s", check=False, timeout=150)
    assert kubectl("-n", NS, "get", "pods", "-l", f"seqtrain.dev/job={name}", "-o", "name").stdout.strip() == ""
