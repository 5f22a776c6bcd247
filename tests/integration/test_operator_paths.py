"""The operator never reads a user's paths: a `data.source: tokens` job and a `model.init` job run on the real
control plane (scripts/testbed.sh). Their data and weights exist only on the checkpoint claim the pods mount (the
node agent maps it to .testbed/volumes/<ns>); the trainer derives the vocabulary and the model's dims there.

Before, the operator filled those fields from its own filesystem and wrote them into the ConfigMap: the tokens job
got vocabSize 256 for 257-id data and the init job the preset's dims; both trainers refused them (exit 3)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_testbed_e2e import cpu_job, losses, wait_phase

from testbed.fixtures import ROOT, TB, Operator, Testbed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    return testbed.checkpoint_namespace("paths")


def _cli(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'trainer'}:{ROOT / 'operator'}"}
    out = subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", *args], capture_output=True, text=True,
                         timeout=900, cwd=cwd, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_a_tokens_job_starting_from_weights_runs_with_what_the_pods_see(
        testbed: Testbed, seqtrain_operator: Operator, ns: str, tmp_path: Path) -> None:
    claim = TB / "volumes" / ns
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join((ROOT / "docs" / "architecture.md").read_text().split("\n\n")[:200]))
    _cli("prepare-data", str(corpus), "--out", str(claim / "data"), cwd=tmp_path)  # byte ids + end-of-doc: 257
    # Weights whose dims are not any preset's, trained here on the same data (a local run, 2 steps).
    model = {"arch": "gpt", "dim": 48, "layers": 2, "heads": 2, "kvHeads": 2, "ffnDim": 96, "maxSeqLen": 64}
    local = cpu_job("weights")
    local["spec"].update(replicas=1, model=model,
                         data={"source": "tokens", "paths": [str(claim / "data")], "seqLen": 64})
    local["spec"]["training"].update(steps=2, globalBatchSize=4, microBatchSize=4)
    del local["spec"]["checkpoint"]["pvc"]
    (tmp_path / "weights.yaml").write_text(yaml.safe_dump(local))
    _cli("run", "weights.yaml", "--workdir", str(tmp_path / "run"), cwd=tmp_path)
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-2", claim / "weights")

    job = cpu_job("tokens-init")
    job["spec"].update(replicas=1, model={"init": "/checkpoints/weights"},
                       data={"source": "tokens", "paths": ["/checkpoints/data"], "seqLen": 64})
    job["spec"]["training"].update(steps=4, globalBatchSize=4, microBatchSize=4)
    testbed.apply(job, ns)
    done = wait_phase(testbed, seqtrain_operator, ns, "tokens-init", "Succeeded")
    assert done["progress"]["step"] == 4, done
    assert sorted(losses(ns, "tokens-init")) == [1, 2, 3, 4]


def test_a_hostile_pod_template_is_refused_at_admission_naming_each_field(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    """The webhook on the real apiserver holds the template to the operator's pod policy (baseline by default)."""
    job = cpu_job("rooted")
    job["spec"]["scheduling"]["tolerations"] = [{"operator": "Exists"}]
    job["spec"]["podTemplate"] = {"spec": {
        "containers": [{"name": "root", "image": "busybox", "securityContext": {"privileged": True},
                        "volumeMounts": [{"name": "host", "mountPath": "/host"}]}],
        "volumes": [{"name": "host", "hostPath": {"path": "/"}}]}}
    out = testbed.apply(job, ns, check=False)
    assert out.returncode != 0
    for field in ("spec.podTemplate.spec.containers[0].securityContext.privileged",
                  "spec.podTemplate.spec.volumes[0].hostPath", "spec.scheduling.tolerations[0]"):
        assert field in out.stderr, out.stderr
    assert testbed.get("seqtrainjob", "rooted", ns) is None
