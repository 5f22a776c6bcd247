"""hf:// on Kubernetes: the init container the operator adds to a job whose model.init is hf://, run here against a
local fake hub; then the trainer, with the environment the pod gives it, reads the model from the volume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_hub_download import COMMIT, TOKEN, Hub_, serve

from jobs import make_job
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.init_source import HF_DIR_ENV, describe_init, local_folder
from seqtrain.spec.policy import PodPolicy, pod_spec_problems
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.pods.hfinit import INIT_CONTAINER, add_hf_init, hf_init_container

OWNER = Owner(name="ft", namespace="ml", uid="1234-abcd")


def job(init: str) -> SeqTrainJob:
    return SeqTrainJob.model_validate(make_job("ft", "ml", replicas=2,
                                               resources={"gpus": 0, "cpu": "2", "memory": "3Gi"},
                                               model={"init": init}))


def pod_with_init(j: SeqTrainJob, secret: str | None = "hub-token") -> dict:
    pod = m.build_pod(j, OWNER, 1, 0, m.Settings())
    add_hf_init(pod["spec"], j, "IfNotPresent", m.CONTAINER, m.CHECKPOINT_MOUNT, secret=secret)
    return pod


def test_only_hf_jobs_get_the_init_container() -> None:
    assert hf_init_container(job("/models/llama"), "IfNotPresent") is None
    pod = pod_with_init(job("/models/llama"))
    assert "initContainers" not in pod["spec"]
    assert HF_DIR_ENV not in {e["name"] for e in pod["spec"]["containers"][0]["env"]}


def test_the_init_container_downloads_into_the_jobs_folder_with_the_token_only_there() -> None:
    pod = pod_with_init(job("hf://org/tiny@v1"))
    init = pod["spec"]["initContainers"][0]
    assert init["name"] == INIT_CONTAINER and init["image"] == pod["spec"]["containers"][0]["image"]
    assert init["command"] == ["python", "-m", "seqtrain.hub", "hf://org/tiny@v1", "--root", "/checkpoints/ft/hf"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in init["volumeMounts"]
    token = [e for e in init["env"] if e["name"] == "HF_TOKEN"]
    assert token == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub-token", "key": "token"}}}]
    trainer = pod["spec"]["containers"][0]
    assert {"name": HF_DIR_ENV, "value": "/checkpoints/ft/hf"} in trainer["env"]
    assert "HF_TOKEN" not in json.dumps(trainer)  # the ranks never see the token
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(pod, "1.33", strict=True)


def test_the_pod_policy_decides_on_the_named_secret() -> None:
    spec = pod_with_init(job("hf://org/tiny"))["spec"]
    assert pod_spec_problems(spec, PodPolicy.of("restricted", secrets=["hub-token"])) == []
    refused = pod_spec_problems(spec, PodPolicy.of("restricted", secrets=["other"]))
    assert [p for p, _ in refused] == ["initContainers[0].env[1].valueFrom.secretKeyRef.name"]
    assert "'hub-token' is not in the pod policy's Secret allowlist" in refused[0][1]
    no_secret = pod_with_init(job("hf://org/tiny"), secret=None)["spec"]
    assert pod_spec_problems(no_secret, PodPolicy.of("restricted")) == []  # a public model needs none


@pytest.mark.slow
def test_the_init_containers_command_then_every_rank_reads_the_volume(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's argv, run here (the volume is tmp_path), against the fake hub; then the trainer's view."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=64).to_dict()
    cfg["model_type"] = "llama"
    state = Hub_()
    state.files["config.json"] = json.dumps(cfg).encode()
    gen = serve(state)
    url, _ = next(gen)
    try:
        init = hf_init_container(job("hf://org/tiny"), "IfNotPresent", checkpoint_mount=str(tmp_path / "ck"),
                                 endpoint=url, secret="hub-token")
        assert init is not None
        env = {**os.environ, **{e["name"]: e["value"] for e in init["env"] if "value" in e}, "HF_TOKEN": TOKEN}
        argv = [sys.executable, *init["command"][1:]]
        for _ in range(2):  # a restarted gang's init container: complete, nothing fetched
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
        assert sum(1 for r in state.requests if r[0] == "hub") == 4  # listing, config, tokenizer, weights: once
    finally:
        with pytest.raises(StopIteration):
            next(gen)
    root = tmp_path / "ck" / "ft" / "hf"
    monkeypatch.setenv(HF_DIR_ENV, str(root))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))  # not in any local cache: the volume only
    assert local_folder("hf://org/tiny") == str(root / "org--tiny" / "main")
    assert json.loads((root / "org--tiny" / "main" / ".seqtrain-download.json").read_text())["commit"] == COMMIT
    described = describe_init("hf://org/tiny")
    assert described is not None and described["vocab_size"] == 128 and described["dim"] == 32
    with pytest.raises(ValueError, match=r"hf://org/other: not downloaded into .*hf-download init container"):
        local_folder("hf://org/other")


def test_hub_token_secret_is_a_model_field_only_for_hf_uris_and_the_policy_decides(monkeypatch) -> None:
    monkeypatch.setenv("SEQTRAIN_CHECK_PATHS", "0")  # as the operator reads it: the model is fetched in the pod
    from seqtrain.spec import SpecError, load_job
    from seqtrain.spec.policy import PodPolicy, job_policy_problems

    base = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: hub}
spec:
  model: {arch: gpt, preset: tiny, hubTokenSecret: hub-token%s}
  data: {source: builtin, seqLen: 32}
  training: {steps: 2, globalBatchSize: 2, microBatchSize: 1}
"""
    with pytest.raises(SpecError, match="hubTokenSecret is for model.init hf://"):
        load_job(base % "")
    job = load_job(base % ', init: "hf://Org/Model"')
    assert job.spec.model.hub_token_secret == "hub-token"
    refused = job_policy_problems(job.spec, PodPolicy.of("restricted"), job.name)
    assert [p.path for p in refused] == ["spec.model.hubTokenSecret"], refused
    assert not job_policy_problems(job.spec, PodPolicy.of("restricted", secrets=["hub-token"]), job.name)
