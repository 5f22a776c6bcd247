"""Mixed precision: fp16 overflow skips the step and halves the scale without touching the weights; the scaler
grows after good steps and round-trips through a checkpoint; bf16/fp16 autocast keeps fp32 master weights."""

from __future__ import annotations

import math

import pytest
import torch

from seqtrain.data import build_train_data
from seqtrain.engine.native import NativeEngine
from seqtrain.models import build_model
from seqtrain.runtime.dist import DistContext
from seqtrain.runtime.precision import DynamicLossScaler, MixedPrecision
from seqtrain.spec import load_job, resolve

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: prec}
spec:
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 32}
  training: {steps: 10, globalBatchSize: 4, microBatchSize: 2, optimizer: {lr: 0.01}, schedule: {name: constant}}
"""


_STEPS: list = []


def make_engine(precision: str, device: str = "cpu") -> tuple[NativeEngine, list]:
    job = resolve(load_job(JOB, [f"optimization.precision={precision}"]))
    torch.manual_seed(0)
    model = build_model(job.spec.model).to(device)
    ctx = DistContext(device=torch.device(device))
    engine = NativeEngine(model, job, ctx)
    if not _STEPS:  # the corpus is the same for every precision: load it once
        data = build_train_data(job, 0, 1)
        _STEPS.extend(data.next_step() for _ in range(3))
    return engine, _STEPS


def params(engine: NativeEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.model.parameters()]


def test_fp16_overflow_skips_step_halves_scale_and_keeps_weights_finite() -> None:
    engine, steps = make_engine("fp16")
    engine.precision.scaler.scale = 1e38  # the scaled loss overflows fp16 (and fp32) in backward
    before = params(engine)
    stats = engine.step(steps[0])
    assert stats.skipped
    assert stats.loss_scale == pytest.approx(0.5e38)
    after = params(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a skipped step changed weights"
    assert all(torch.isfinite(p).all() for p in after)
    assert all(p.grad is None for p in engine.model.parameters()), "overflowed gradients must be dropped"
    # with a sane scale the next step applies and the weights stay finite
    engine.precision.scaler.scale = 2.0**12
    stats = engine.step(steps[1])
    assert not stats.skipped and math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)
    assert any(not torch.equal(a, b) for a, b in zip(after, params(engine), strict=True))
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())
    assert engine.state_dict()["precision"]["scaler"]["skipped_steps"] == 1


def test_fp16_matches_fp32_step_and_reports_loss_scale() -> None:
    e32, steps = make_engine("fp32")
    e16, _ = make_engine("fp16")
    s32, s16 = e32.step(steps[0]), e16.step(steps[0])
    assert s32.loss_scale is None and s16.loss_scale == 2.0**16
    assert s16.loss == pytest.approx(s32.loss, rel=1e-2)
    assert s16.grad_norm == pytest.approx(s32.grad_norm, rel=5e-2)  # unscaled: same magnitude as fp32
    assert all(p.dtype == torch.float32 for p in e16.model.parameters()), "master weights must stay fp32"


def test_bf16_autocast_runs_matmuls_in_bf16_and_keeps_fp32_weights() -> None:
    mp = MixedPrecision("bf16", "cpu")
    w = torch.randn(8, 8)
    with mp.autocast():
        assert (w @ w).dtype == torch.bfloat16
    e32, steps = make_engine("fp32")
    ebf, _ = make_engine("bf16")
    s32, sbf = e32.step(steps[0]), ebf.step(steps[0])
    assert sbf.loss == pytest.approx(s32.loss, rel=2e-2) and sbf.loss_scale is None
    assert all(p.dtype == torch.float32 for p in ebf.model.parameters())


def test_scaler_grows_after_interval_and_round_trips() -> None:
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    for _ in range(2):
        s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0
    s.update(True)
    assert s.scale == 8.0 and s.good_steps == 0
    s2 = DynamicLossScaler()
    s2.load_state_dict(s.state_dict())
    assert s2.state_dict() == s.state_dict()


def test_unscale_divides_gradients_and_flags_non_finite() -> None:
    s = DynamicLossScaler(init_scale=4.0)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([4.0, 8.0, -12.0])
    assert s.unscale_([p]) is False
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, -3.0]))
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert s.unscale_([p]) is True


def test_unknown_precision_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="optimization.precision"):
        MixedPrecision("fp8", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_autocast_step(precision: str) -> None:
    engine, steps = make_engine(precision, "cuda")
    stats = engine.step(steps[0])
    assert math.isfinite(stats.loss) and not stats.skipped
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
