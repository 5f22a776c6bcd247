"""Defaults a GPU user wants, checked on the CPU with `torch.cuda` monkeypatched: `precision: auto` and
`compile: auto` resolve per device (the CPU keeps fp32 and eager), the launcher turns on expandable segments, and
more ranks than GPUs on a node is a one-line error."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from seqtrain.models import build_model
from seqtrain.models.compile import CompileState, prepare_model
from seqtrain.runtime import launch
from seqtrain.runtime.dist import DistContext, init_distributed
from seqtrain.runtime.exitcodes import InvalidConfig
from seqtrain.runtime.precision import MixedPrecision, resolve_auto
from seqtrain.spec import apply_overrides, parse_job, resolve
from seqtrain.spec.optimization import AUTO_PRECISION, resolve_compile, resolve_precision
from seqtrain_operator.planner.local import local_plan
from seqtrain_operator.planner.memory import estimate
from seqtrain_operator.planner.show import plan_dict, render

BASE = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: gpudefaults}
spec:
  model: {arch: gpt, preset: tiny}
  data: {seqLen: 32}
  training: {globalBatchSize: 8, microBatchSize: 8}
"""


def job(**sets: object):
    doc = apply_overrides(yaml.safe_load(BASE), [f"{k}={v}" for k, v in sets.items()])
    return parse_job(doc, check_features=False)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """A CUDA runtime with `count` devices and bf16 as told, without a GPU (nothing allocates on it)."""
    state = {"count": 1, "bf16": True, "set_device": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: state["bf16"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: state["set_device"].append(d))
    return state


@pytest.mark.parametrize(("precision", "device", "bf16", "expected"), [
    ("auto", "cpu", False, "fp32"), ("auto", "cpu", True, "fp32"), ("auto", "cuda", True, "bf16"),
    ("auto", "cuda", False, "fp32"), ("fp16", "cuda", True, "fp16"), ("bf16", "cpu", False, "bf16"),
    ("fp32", "cuda", True, "fp32"),
])
def test_precision_auto_table(precision: str, device: str, bf16: bool, expected: str) -> None:
    assert resolve_precision(precision, device, bf16) == expected


@pytest.mark.parametrize(("value", "device", "expected"), [
    ("auto", "cpu", False), ("auto", "cuda", True), (False, "cuda", False), (True, "cpu", True)])
def test_compile_auto_table(value: bool | str, device: str, expected: bool) -> None:
    assert resolve_compile(value, device) is expected


def test_the_spec_defaults_are_auto() -> None:
    opt = job().spec.optimization
    assert (opt.precision, opt.compile) == ("auto", "auto")
    assert job(**{"optimization.compile": "true"}).spec.optimization.compile is True  # a bool still parses


def test_cpu_resolves_to_fp32_and_eager() -> None:
    j = resolve_auto(job(), torch.device("cpu"))
    assert (j.spec.optimization.precision, j.spec.optimization.compile) == ("fp32", False)
    assert MixedPrecision("auto", "cpu").name == "fp32"
    explicit = job(**{"optimization.precision": "bf16", "optimization.compile": "false"})
    assert resolve_auto(explicit, torch.device("cpu")) is explicit  # nothing to resolve: the same object


def test_cuda_resolves_to_bf16_and_compiled(fake_cuda) -> None:
    j = resolve_auto(job(), torch.device("cuda", 0))
    assert (j.spec.optimization.precision, j.spec.optimization.compile) == ("bf16", True)
    fake_cuda["bf16"] = False  # a GPU without bf16 (before Ampere): fp32, still compiled
    j = resolve_auto(job(), torch.device("cuda", 0))
    assert (j.spec.optimization.precision, j.spec.optimization.compile) == ("fp32", True)
    kept = resolve_auto(job(**{"optimization.precision": "fp16", "optimization.compile": "false"}),
                        torch.device("cuda", 0))
    assert (kept.spec.optimization.precision, kept.spec.optimization.compile) == ("fp16", False)


def test_trainer_sees_the_resolved_job() -> None:
    from seqtrain.spec.runtime import RuntimeConfig
    from seqtrain.train.loop import Trainer

    trainer = Trainer(job(), RuntimeConfig(workdir="/nonexistent-unused", checkpoint_dir="/nonexistent-unused/ck"), DistContext())
    assert (trainer.spec.optimization.precision, trainer.job.spec.optimization.compile) == ("fp32", False)


def test_auto_compile_leaves_cpu_blocks_eager() -> None:
    j = resolve(job())
    model = build_model(j.spec.model)
    assert prepare_model(model, j, torch.device("cpu")) == []
    assert not any(isinstance(getattr(m, "compile_state", None), CompileState) for m in model.modules())


def test_plan_shows_what_auto_becomes() -> None:
    cpu = job()
    d = plan_dict(cpu, local_plan(cpu))
    assert d["precision"] == "fp32 (auto: no GPU)" and d["compile"] == "off (auto: no GPU)"
    assert estimate(cpu).precision == "fp32"  # CPU estimates keep full-precision bytes
    gpu = job(**{"resources.gpus": 1})
    d = plan_dict(gpu, local_plan(gpu))
    assert d["precision"] == AUTO_PRECISION and "auto" in d["compile"]
    assert estimate(gpu).precision == "bf16" and f"precision {AUTO_PRECISION}" in render(d)
    explicit = job(**{"optimization.precision": "fp16", "optimization.compile": "true"})
    d = plan_dict(explicit, local_plan(explicit))
    assert (d["precision"], d["compile"]) == ("fp16", "on")


def test_launcher_turns_on_expandable_segments_unless_set() -> None:
    envs = launch.rank_envs(2, {})
    assert {e["PYTORCH_CUDA_ALLOC_CONF"] for e in envs} == {"expandable_segments:True"}
    envs = launch.rank_envs(2, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert all("PYTORCH_CUDA_ALLOC_CONF" not in e for e in envs)  # the user's own value reaches the child as is


def test_more_ranks_than_gpus_is_one_line_error(fake_cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda["count"] = 1
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(InvalidConfig) as err:
        init_distributed(use_gpu=True)
    msg = str(err.value)
    assert "\n" not in msg and "processesPerReplica" in msg and "1 CUDA device" in msg
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")  # rank 0 of the same node refuses too: every rank says why
    with pytest.raises(InvalidConfig):
        init_distributed(use_gpu=True)
    assert fake_cuda["set_device"] == []


def test_a_cuda_rank_takes_its_own_device_and_sets_the_allocator(fake_cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda["count"] = 2
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.setenv(k, "0")  # recorded, so teardown restores what the test process had
        monkeypatch.delenv(k)
    ctx = init_distributed(use_gpu=True)
    assert ctx.device == torch.device("cuda", 0) and fake_cuda["set_device"] == [torch.device("cuda", 0)]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_validate_notes_what_auto_becomes_for_a_gpu_job_only() -> None:
    from seqtrain.spec.resolve import job_notes

    gpu_notes = job_notes(job(**{"resources.gpus": 1}))
    assert any(AUTO_PRECISION in n and "compile auto: on with CUDA" in n for n in gpu_notes)
    assert not any("optimization:" in n for n in job_notes(job()))  # the CPU runs what it always ran
    explicit = job(**{"resources.gpus": 1, "optimization.precision": "bf16", "optimization.compile": "false",
                      "optimization.fusedProjections": "true"})
    assert not any("optimization:" in n for n in job_notes(explicit))
