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

SYNCS = ("tolist", "item", "__float__", "__bool__", "__int__")
_STEPS: list = []


def fused_engine(monkeypatch: pytest.MonkeyPatch, fused: bool = True) -> NativeEngine:
    job = resolve(load_job(JOB))
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


def test_no_host_sync_before_the_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = fused_engine(monkeypatch)
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
