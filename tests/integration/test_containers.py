"""The README's kind path on container nodes: the images `make images` built, the operator and the trainers
running in them (scripts/testbed.sh up --containers: podman + runc, tests/testbed/containers.py).

Exactly what a kind user runs, on the test control plane: `helm install charts/seqtrain --wait` (the operator pod
from its image, the webhook served from it), examples/kind/checkpoint-volume.yaml, `kubectl apply -f
examples/k8s-cpu.yaml`. Then a crash (`testbed.sh kill-container`: SIGKILL of a trainer container's main process)
restarts the gang from its checkpoint and the loss continues exactly, and a job over its memory limit is OOM-killed
by the kernel and classified as docs/user-guide.md says.

Needs root, podman and the two images (`make images`, which `make test` runs under CI=true): without them the
tests skip, under CI=true they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.fixtures import ROOT, SCRIPT, TB, UP_TIMEOUT, Testbed, binaries, tool, unavailable, wait

pytestmark = [pytest.mark.slow, pytest.mark.control_plane]

CTB = TB.parent / f"{TB.name}-containers"  # a control plane of its own: its nodes run containers, not processes
CKPT = Path("/mnt/seqtrain-ckpt")  # the hostPath of examples/kind/checkpoint-volume.yaml's PV, on this "node"
RUN_TIMEOUT = 900  # a deadline for a 60-step 2-replica CPU run on a loaded 2-core machine, not a measurement
NS = "default"  # the README applies the example and the claim there


def images() -> list[str]:
    return subprocess.run(["make", "-s", "print-images"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.fixture(scope="module")
def ctb() -> Iterator[Testbed]:
    if os.geteuid() != 0 or not shutil.which("podman") or not shutil.which("runc"):
        unavailable("container nodes need root, podman and runc (`make images` installs them)")
    for image in images():
        if subprocess.run(["podman", "image", "exists", image]).returncode != 0:
            unavailable(f"image {image} not built: run `make images`")
    env = {"TESTBED_DIR": str(CTB), "SEQTRAIN_K8S_BIN": binaries(), "KUBECTL": tool("kubectl")}
    tool("helm")
    full = {**os.environ, **env}
    load = subprocess.run([str(SCRIPT), "load-images"], capture_output=True, text=True, env=full, timeout=600)
    assert load.returncode == 0, load.stderr
    out = subprocess.run([str(SCRIPT), "up", "--containers"], capture_output=True, text=True, env=full,
                         timeout=UP_TIMEOUT)
    if out.returncode != 0:
        subprocess.run([str(SCRIPT), "down"], capture_output=True, env=full, timeout=180)
        unavailable(f"scripts/testbed.sh up --containers failed:\n{out.stderr[-3000:]}")
    line = [x for x in out.stdout.splitlines() if x.startswith("KUBECONFIG=")][-1]
    try:
        yield Testbed(Path(line.split("=", 1)[1]), env)
    finally:
        subprocess.run([str(SCRIPT), "down"], capture_output=True, env=full, timeout=180)


def operator_logs(tb: Testbed) -> str:
    return tb.kubectl("logs", "-n", "seqtrain-system", "deploy/seqtrain", "--tail=60", check=False).stdout


def wait_phase(tb: Testbed, name: str, phase: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        st = ((tb.get("seqtrainjob", name, NS) or {}).get("status")) or {}
        if st.get("phase") == "Failed" and phase != "Failed":
            pytest.fail(f"{name} failed: {st.get('message')}\noperator log:\n{operator_logs(tb)}", pytrace=False)
        return st if st.get("phase") == phase else None
    return wait(f"{name} {phase}", probe, RUN_TIMEOUT, interval=2)


def losses(job: str) -> dict[int, float]:
    """step -> loss from the run's metrics.jsonl, which the ranks wrote into the claim's host folder."""
    out: dict[int, float] = {}
    for line in (CKPT / job / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["step"] not in out, f"step {rec['step']} appears twice in {job}'s metrics.jsonl"
        out[rec["step"]] = rec["loss"]
    return out


def example(name: str, **env: str) -> dict[str, Any]:
    """examples/k8s-cpu.yaml under another name; `env` goes to the trainer container through the pod template."""
    job = yaml.safe_load((ROOT / "examples" / "k8s-cpu.yaml").read_text())
    job["metadata"]["name"] = name
    if env:
        job["spec"]["podTemplate"] = {"spec": {"containers": [
            {"name": "trainer", "env": [{"name": k, "value": v} for k, v in env.items()]}]}}
    return job


@pytest.fixture(scope="module")
def installed(ctb: Testbed) -> Testbed:
    """The README's kind path up to the job: the chart with no overrides, the checkpoint volume's host folder."""
    for job in ("cpu-demo", "cpu-crash", "cpu-oom"):  # a previous run's checkpoints would be resumed from
        shutil.rmtree(CKPT / job, ignore_errors=True)
    CKPT.mkdir(parents=True, exist_ok=True)
    CKPT.chmod(0o777)  # README: `mkdir -p /tmp/seqtrain-ckpt && chmod 0777 /tmp/seqtrain-ckpt`
    ctb.helm("install", "seqtrain", str(ROOT / "charts" / "seqtrain"), "--namespace", "seqtrain-system",
             "--create-namespace", "--wait", "--timeout", "300s", timeout=420)
    ctb.kubectl("apply", "-f", str(ROOT / "examples" / "kind" / "checkpoint-volume.yaml"))
    wait("the checkpoint claim Bound",
         lambda: (ctb.get("pvc", "seqtrain-ckpt", NS) or {}).get("status", {}).get("phase") == "Bound", 120)
    return ctb


@pytest.mark.timeout(3 * RUN_TIMEOUT + 600)
def test_readme_kind_path_in_containers_a_crash_resumes_exactly(installed: Testbed) -> None:
    tb = installed
    # The operator runs from its image under the chart's Deployment: a real container, as uid 1000.
    [op] = tb.get("pods", namespace="seqtrain-system", selector="app.kubernetes.io/component=operator")
    st = op["status"]["containerStatuses"][0]
    assert st["ready"] is True and st["containerID"].startswith("podman://"), st
    assert st["image"] == images()[1] and "@sha256:" in st["imageID"], st
    # Its webhook, served from the pod through the chart's Service, refuses an invalid job naming the field.
    bad = tb.apply({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "invalid"},
                    "spec": {"replicas": 2, "training": {"globalBatchSize": 3, "microBatchSize": 1}}}, NS, check=False)
    assert bad.returncode != 0 and "spec.training.globalBatchSize" in bad.stderr, bad.stderr

    # examples/k8s-cpu.yaml as it is: the reference run.
    tb.kubectl("apply", "-f", str(ROOT / "examples" / "k8s-cpu.yaml"))

    def running() -> list[dict[str, Any]] | None:
        pods = [p for p in tb.get("pods", namespace=NS, selector="seqtrain.dev/job=cpu-demo")
                if p["status"].get("phase") == "Running"]
        return pods if len(pods) == 2 else None
    pods = wait("cpu-demo's two pods Running", running, RUN_TIMEOUT)
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["cpu-0", "cpu-1"]  # spread: one per node
    for p in pods:
        cs = p["status"]["containerStatuses"][0]
        assert cs["containerID"].startswith("podman://") and cs["image"] == images()[0], cs
        assert cs["imageID"].startswith(images()[0].rsplit(":", 1)[0] + "@sha256:"), cs
    done = wait_phase(tb, "cpu-demo", "Succeeded")
    steps = yaml.safe_load((ROOT / "examples" / "k8s-cpu.yaml").read_text())["spec"]["training"]["steps"]
    assert done["progress"]["step"] == steps
    reference = losses("cpu-demo")
    assert sorted(reference) == list(range(1, steps + 1))
    # The trainers ran as uid 1000 and wrote the checkpoint volume as that user.
    written = [p for p in (CKPT / "cpu-demo").rglob("*") if p.is_file()]
    assert written and {p.stat().st_uid for p in written} == {1000}, {p: p.stat().st_uid for p in written}

    # The same job, crashed: SIGKILL of replica 1's main process once it is past its checkpoint at step 10 (the
    # first attempt holds at step 12 until then; restarted gangs run clean).
    tb.apply(example("cpu-crash", SEQTRAIN_FAULT_HOLD_AT_STEP="12:900", SEQTRAIN_FAULT_ATTEMPT="1"), NS)
    metrics = CKPT / "cpu-crash" / "metrics.jsonl"
    wait("cpu-crash past its first checkpoint (step 10)",
         lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 12, RUN_TIMEOUT, 0.5)
    [victim] = tb.get("pods", namespace=NS, selector="seqtrain.dev/job=cpu-crash,seqtrain.dev/replica=1")
    tb.run(str(SCRIPT), "kill-container", victim["metadata"]["name"], NS)
    done = wait_phase(tb, "cpu-crash", "Succeeded")
    assert done["attempt"] >= 2 and done["restarts"] >= 1, done
    assert losses("cpu-crash") == reference  # every step once, the losses of the uninterrupted run


@pytest.mark.timeout(RUN_TIMEOUT + 300)
def test_a_job_over_its_memory_limit_is_oom_killed_by_the_kernel(installed: Testbed) -> None:
    tb = installed
    job = example("cpu-oom")
    job["spec"]["resources"]["memory"] = "160Mi"  # importing torch alone takes more
    job["spec"]["faultTolerance"]["maxRestarts"] = 0
    tb.apply(job, NS)
    done = wait_phase(tb, "cpu-oom", "Failed")
    # docs/user-guide.md, failure classes: OOMKilled is a user failure whose message says to raise resources.memory.
    assert "OOMKilled" in done["message"] and "resources.memory" in done["message"], done
