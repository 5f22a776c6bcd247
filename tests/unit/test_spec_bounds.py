"""Hostile or careless specs are refused with the field and the fix (exit 2), before anything expands or runs:
bounds on every count, size, quantity and rate; strict integers; no `..` in the checkpoint path; duplicate keys and
alias bombs in the YAML; a tokenizer that is not there; a plan whose memory estimate exceeds what the job asks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobs import make_job
from seqtrain.spec import SpecError, load_job, parse_job

ROOT = Path(__file__).resolve().parents[2]
HEAD = "apiVersion: seqtrain.dev/v1alpha1\nkind: SeqTrainJob\nmetadata: {name: j}\n"


def doc(**spec: object) -> dict:
    return make_job("j", **spec)


def refused(spec: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        parse_job(doc(**spec))
    return {p.path: p.message for p in err.value.problems}


@pytest.mark.parametrize("spec,path,words", [
    ({"replicas": 100000, "training": {"globalBatchSize": 800000}}, "spec.replicas", "less than or equal"),
    ({"training": {"steps": 10**29}}, "spec.training.steps", "less than or equal"),
    ({"training": {"steps": True}}, "spec.training.steps", "not a boolean"),
    ({"training": {"optimizer": {"lr": True}}}, "spec.training.optimizer.lr", "not a boolean"),
    ({"training": {"optimizer": {"lr": float("inf")}}}, "spec.training.optimizer.lr", "finite"),
    ({"training": {"optimizer": {"lr": float("nan")}}}, "spec.training.optimizer.lr", "finite"),
    ({"training": {"optimizer": {"lr": 0}}}, "spec.training.optimizer.lr", "greater than 0"),
    ({"training": {"optimizer": {"betas": [2, 3]}}}, "spec.training.optimizer.betas", "[0, 1)"),
    ({"training": {"optimizer": {"betas": [0.9, 1.0]}}}, "spec.training.optimizer.betas", "[0, 1)"),
    ({"faultTolerance": {"backoffSeconds": float("inf")}}, "spec.faultTolerance.backoffSeconds", "finite"),
    ({"data": {"seqLen": 10**8}}, "spec.data.seqLen", "less than or equal"),
    ({"model": {"dim": 10**7}}, "spec.model.dim", "less than or equal"),
    ({"resources": {"memory": "1e999"}}, "spec.resources.memory", "at most 1Pi"),
    ({"resources": {"memory": "2Ei"}}, "spec.resources.memory", "at most 1Pi"),
    ({"resources": {"cpu": "1e9"}}, "spec.resources.cpu", "CPUs"),
    ({"resources": {"shmSize": "9Ei"}}, "spec.resources.shmSize", "at most"),
    ({"checkpoint": {"path": "../../etc"}}, "spec.checkpoint.path", "'..'"),
    ({"checkpoint": {"path": "/checkpoints/a/../../etc"}}, "spec.checkpoint.path", "'..'"),
    ({"data": {"tokenizer": {"type": "file", "path": "/nonexistent/tokenizer.json"}}},
     "spec.data.tokenizer.path", "is not a file"),
])
def test_insane_values_are_refused_naming_the_field(spec, path, words):
    got = refused(spec)
    assert path in got and words in got[path], got


def test_sane_values_at_the_edges_still_pass():
    job = parse_job(doc(replicas=64, resources={"memory": "1Ti", "cpu": "500m"},
                        training={"steps": 10**6, "globalBatchSize": 64, "microBatchSize": 1,
                                  "optimizer": {"betas": [0.0, 0.999], "lr": 1.0}},
                        checkpoint={"path": "/checkpoints/gpt-runs/x..y"}, suspend=True))
    assert job.spec.suspend is True and job.spec.training.optimizer.betas == (0.0, 0.999)


def test_duplicate_keys_are_refused_not_last_wins():
    with pytest.raises(SpecError) as err:
        load_job(HEAD + "spec:\n  training:\n    steps: 10\n    steps: 100000\n")
    (p,) = err.value.problems
    assert p.path == "<yaml>" and "duplicate key 'steps'" in p.message and "line 6" in p.message


def test_an_alias_bomb_is_refused_before_it_expands():
    lines = [HEAD.rstrip("\n"), "x0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    lines += ["spec: {podTemplate: {metadata: {labels: {bomb: *a9}}}}"]
    with pytest.raises(SpecError) as err:
        load_job("\n".join(lines) + "\n")
    (p,) = err.value.problems
    assert p.path == "<yaml>" and "aliases" in p.message
    # a few plain anchors stay legal
    job = load_job(HEAD + "spec:\n  training: {steps: &n 20}\n  checkpoint: {intervalSteps: *n}\n")
    assert job.spec.checkpoint.interval_steps == 20


def plan(path: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "seqtrain_operator.cli", "plan", str(path)]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"PYTHONPATH": f"{ROOT / 'trainer'}:{ROOT / 'operator'}", "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_plan_exits_2_when_the_estimate_exceeds_the_replicas_memory():
    quick = ROOT / "examples" / "quickstart.yaml"
    assert plan(quick).returncode == 0
    out = plan(quick, "data.seqLen=100000", "model.maxSeqLen=100000")
    assert out.returncode == 2, out.stderr
    line = next(ln for ln in out.stderr.splitlines() if "spec.resources.memory" in ln)
    assert line.startswith(f"{quick}: spec.resources.memory: the estimate needs") and "data.seqLen" in line
    gpu = ROOT / "examples" / "k8s-gpu-topology.yaml"
    assert plan(gpu, "resources.gpuProduct=NVIDIA-H100-80GB-HBM3").returncode == 0
    out = plan(gpu, "resources.gpuProduct=NVIDIA-H100-80GB-HBM3", "data.seqLen=65536", "model.maxSeqLen=65536")
    assert out.returncode == 2 and "spec.resources.gpuProduct: the estimate needs" in out.stderr, out.stderr
