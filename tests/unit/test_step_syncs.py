"""No host sync before the optimizer step: the CPU proxy for `cudaStreamSynchronize`.

On CUDA a tensor read on the host (`.tolist()`, `.item()`, `float(t)`, `bool(t)`) or a tensor built from host data
on the device (`torch.tensor(x, device=...)`, a blocking copy from pageable memory) makes the CPU wait for the GPU.
One step of a tiny model runs on the CPU with those entry points counted, in the order they happen relative to
`optimizer.step()`. The optimizer is PyTorch's fused AdamW, which the engine builds on CUDA (fused runs on the CPU
too), so this is the path a GPU takes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from seqtrain.data import build_train_data
from seqtrain.engine import base
from seqtrain.engine.native import NativeEngine
from seqtrain.models import build_model
from seqtrain.runtime.dist import DistContext
from seqtrain.spec import load_job, resolve

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: syncs}
spec:
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 32}
  training: {steps: 4, globalBatchSize: 4, microBatchSize: 2, optimizer: {lr: 0.01}, schedule: {name: constant},
             gradClip: 1.0}
"""

SYNCS = ("tolist", "item", "__float__", "__bool__", "__int__", "cpu", "numpy")
_STEPS: list = []


def fused_engine(monkeypatch: pytest.MonkeyPatch, fused: bool = True, param_dtype: str = "fp32") -> NativeEngine:
    sets = ["optimization.precision=bf16", "optimization.paramDtype=bf16"] if param_dtype == "bf16" else []
    job = resolve(load_job(JOB, sets))
    torch.manual_seed(0)
    model = build_model(job.spec.model)
    monkeypatch.setattr(base, "build_optimizer",
                        lambda m, spec: torch.optim.AdamW(m.parameters(), lr=0.01, fused=fused or None))
    if not _STEPS:
        _STEPS.extend(build_train_data(job, 0, 1).next_step() for _ in range(2))
    return NativeEngine(model, job, DistContext())


def record(monkeypatch: pytest.MonkeyPatch, engine: NativeEngine) -> list[str]:
    """Events in order: each host read of a tensor, each tensor built on a device from host data, the step."""
    events: list[str] = []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _name: str = name, _orig: Any = original, **k: Any) -> Any:
            events.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    tensor = torch.tensor

    def built(*a: Any, **k: Any) -> torch.Tensor:
        if k.get("device") is not None:
            events.append("torch.tensor(device=)")
        return tensor(*a, **k)

    monkeypatch.setattr(torch, "tensor", built)
    step = engine.optimizer.step

    def stepped(*a: Any, **k: Any) -> Any:
        events.append("optimizer.step")
        return step(*a, **k)

    monkeypatch.setattr(engine.optimizer, "step", stepped)
    return events


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_no_host_sync_before_the_optimizer_step(param_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = fused_engine(monkeypatch, param_dtype=param_dtype)
    events = record(monkeypatch, engine)
    stats = engine.step(_STEPS[0])
    monkeypatch.undo()
    assert "optimizer.step" in events, events
    before = events[:events.index("optimizer.step")]
    assert before == [], f"host syncs before optimizer.step(): {before}"
    assert events.count("tolist") == 1  # the step's figures, read once after the update is queued
    assert stats.target_tokens > 0 and math.isfinite(stats.loss) and not stats.skipped


def test_a_non_finite_gradient_is_skipped_on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = fused_engine(monkeypatch)
    engine.step(_STEPS[0])  # optimizer state exists: a skipped step must leave it, too, untouched
    weights = [p.detach().clone() for p in engine.model.parameters()]
    steps = [s["step"].clone() for s in engine.optimizer.state.values()]
    poisoned = engine.model.blocks[0].register_full_backward_hook(
        lambda mod, gin, gout: tuple(None if g is None else torch.full_like(g, math.nan) for g in gin))
    stats = engine.step(_STEPS[1])
    poisoned.remove()
    assert stats.skipped and not math.isfinite(stats.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(weights, engine.model.parameters(), strict=True))
    assert all(torch.equal(a, s["step"]) for a, s in zip(steps, engine.optimizer.state.values(), strict=True))
    assert not hasattr(engine.optimizer, "found_inf")  # the flag lives for one step only
    assert not engine.step(_STEPS[0]).skipped  # and the next good step updates again


def test_fused_and_host_decided_paths_report_the_same_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    fused = fused_engine(monkeypatch).step(_STEPS[0])
    plain = fused_engine(monkeypatch, fused=False).step(_STEPS[0])
    assert (fused.loss_sum, fused.target_tokens, fused.slots) == (plain.loss_sum, plain.target_tokens, plain.slots)
    assert fused.grad_norm == pytest.approx(plain.grad_norm, rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_cuda_synchronization_before_the_optimizer_step_on_a_gpu() -> None:
    """The real check: CUDA's sync debug mode raises at any synchronizing call from the engine's first device
    operation of a step until `optimizer.step()` (the engine's own fused AdamW on CUDA)."""
    from seqtrain.data import Batch

    job = resolve(load_job(JOB))
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    engine = NativeEngine(build_model(job.spec.model).to(device), job, DistContext(device=device))
    assert base.skips_on_device(engine.optimizer)
    if not _STEPS:
        _STEPS.extend(build_train_data(job, 0, 1).next_step() for _ in range(2))
    engine.step(_STEPS[0])  # lazy initialisation (optimizer state, cuBLAS handles) may sync: not this check's
    pinned = [Batch(tokens=b.tokens.pin_memory(), targets=b.targets.pin_memory(),  # what the prefetcher hands over
                    doc_ids=None if b.doc_ids is None else b.doc_ids.pin_memory()) for b in _STEPS[1]]
    step = engine.optimizer.step

    def stepped(*a: Any, **k: Any) -> Any:
        torch.cuda.set_sync_debug_mode(0)  # from here on the step may read its figures
        return step(*a, **k)

    engine.optimizer.step = stepped
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = engine.step(pinned)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert stats.target_tokens > 0 and math.isfinite(stats.loss) and not stats.skipped


PIPELINE_JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: syncs-pp}
spec:
  replicas: 2
  model: {arch: gpt, preset: tiny, layers: 4}
  data: {source: builtin, seqLen: 32}
  training: {steps: 4, globalBatchSize: 4, microBatchSize: 2, optimizer: {lr: 0.01}, schedule: {name: constant},
             gradClip: 1.0}
  optimization: {pipelineParallel: 2}
"""


def _pipeline_rank(rank: int, port: int, out: str) -> None:
    import json
    import os

    from seqtrain.engine.pipeline import PipelineEngine
    from seqtrain.parallel.mesh import init_mesh
    from seqtrain.runtime.dist import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    job = resolve(load_job(PIPELINE_JOB))
    ctx = init_mesh(init_distributed(use_gpu=False), job)
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(base, "build_optimizer", lambda m, spec: torch.optim.AdamW(m.parameters(), lr=0.01, fused=True))
        engine = PipelineEngine(build_model(job.spec.model), job, ctx)
    batches = build_train_data(job, ctx.dp_rank, ctx.dp_size).next_step()
    engine.step(batches)  # the schedule's first step allocates its buffers and shapes: not this check's
    with pytest.MonkeyPatch.context() as mp:
        events = record(mp, engine)
        stats = engine.step(batches)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"events": events, "loss": stats.loss, "skipped": stats.skipped}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # gloo's threads can abort the interpreter's shutdown (see test_accumulation)


@pytest.mark.slow
def test_no_host_sync_before_the_optimizer_step_of_a_pipeline_stage(tmp_path) -> None:  # noqa: ANN001
    """Both stages of a 2-stage pipeline (1F1B, tied embeddings) with a fused AdamW: the schedule, the tied and
    data-parallel gradient sums and the mesh-wide norm queue their work; the figures are read once, after the update."""
    import json

    import torch.multiprocessing as mp

    from seqtrain.runtime.launch import free_port

    out = str(tmp_path / "events")
    mp.spawn(_pipeline_rank, args=(free_port(), out), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"events.{rank}").read_text())
        events = got["events"]
        assert "optimizer.step" in events, (rank, events)
        before = events[:events.index("optimizer.step")]
        assert before == [], f"rank {rank}: host syncs before optimizer.step(): {before}"
        assert events.count("tolist") == 1, (rank, events)
        assert math.isfinite(got["loss"]) and not got["skipped"]
