"""The operator never reads a user's paths: it writes the fields the user set into the ConfigMap, and the trainer
derives vocabulary and shapes where the prepared data and the weights are (before, the operator filled them from
its own filesystem: a tokens job got vocabSize 256, a model.init job the preset's dims)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import make_job
from seqtrain.spec import TrainerConfig, parse_job, resolve
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m

OWNER = Owner(name="j", namespace="ml", uid="u")


def _doc(**spec: object) -> dict:
    return make_job("j", **{"training": {"steps": 4, "globalBatchSize": 2, "microBatchSize": 2}, **spec})


def _configmap_job(doc: dict, monkeypatch: pytest.MonkeyPatch) -> dict:
    """What the operator (SEQTRAIN_CHECK_PATHS=0, as `seqtrain operator` sets) writes into the ConfigMap."""
    monkeypatch.setenv("SEQTRAIN_CHECK_PATHS", "0")
    cm = m.build_configmap(parse_job(doc), OWNER, 1, m.Settings())
    monkeypatch.setenv("SEQTRAIN_CHECK_PATHS", "1")  # the trainer, in the pod, where the files are
    return TrainerConfig.model_validate(json.loads(cm["data"]["config.json"])).job


def test_a_tokens_job_gets_its_vocabulary_from_the_prepared_data_in_the_trainer(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch):
    data = tmp_path / "tokens"
    data.mkdir()
    (data / "index.json").write_text(json.dumps({"vocab_size": 300}))
    job = _configmap_job(_doc(data={"source": "tokens", "paths": [str(data)], "seqLen": 32}), monkeypatch)
    assert "vocabSize" not in job["spec"].get("model", {})
    assert resolve(parse_job(job)).spec.model.vocab_size == 300


def test_a_model_init_job_gets_the_weights_dims_in_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    weights = tmp_path / "export"
    weights.mkdir()
    (weights / "seqtrain.json").write_text(json.dumps({"model": {
        "arch": "gpt", "vocabSize": 256, "dim": 48, "layers": 3, "heads": 3, "kvHeads": 3, "ffnDim": 128,
        "maxSeqLen": 64}}))
    job = _configmap_job(_doc(model={"init": str(weights)}, data={"seqLen": 32}), monkeypatch)
    assert job["spec"]["model"] == {"init": str(weights)}
    model = resolve(parse_job(job)).spec.model
    assert (model.dim, model.layers, model.heads, model.ffn_dim) == (48, 3, 3, 128)


def test_the_operator_opens_no_file_a_job_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A path a user names (here: a folder of the operator's own) is never opened by the operator's validation."""
    secret = tmp_path / "operator-only"
    secret.mkdir()
    (secret / "seqtrain.json").write_text(json.dumps({"model": {"arch": "gpt", "dim": 4096, "layers": 2}}))
    (secret / "index.json").write_text(json.dumps({"vocab_size": 999}))
    opened: list[str] = []
    real_open = open

    def spy(path, *a, **k):  # noqa: ANN001, ANN002, ANN003
        opened.append(str(path))
        return real_open(path, *a, **k)

    monkeypatch.setenv("SEQTRAIN_CHECK_PATHS", "0")
    monkeypatch.setattr("builtins.open", spy)
    parse_job(_doc(model={"init": str(secret), "dim": 64}, data={"source": "tokens", "paths": [str(secret)]}))
    assert not [p for p in opened if p.startswith(str(secret))]
