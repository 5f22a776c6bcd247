"""The NaN-loss drill (SEQTRAIN_FAULT_NAN_FILE, the chaos soak's nan-loss kind): the file's appearance makes the next
micro-batch's loss NaN once; the engine skips that update (weights untouched, nothing non-finite in them) and the
next step trains normally."""

from __future__ import annotations

import math

import torch

from seqtrain.data import build_train_data
from seqtrain.engine.native import NativeEngine
from seqtrain.models import build_model
from seqtrain.runtime import faults
from seqtrain.runtime.dist import DistContext
from seqtrain.spec import load_job, resolve

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: nan}
spec:
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 32}
  training: {steps: 4, globalBatchSize: 4, microBatchSize: 2, optimizer: {lr: 0.01}, schedule: {name: constant}}
"""


def test_poison_loss_fires_once_on_rank_0_only(tmp_path, monkeypatch) -> None:
    trigger = tmp_path / "nan"
    monkeypatch.setenv("SEQTRAIN_FAULT_NAN_FILE", str(trigger))
    one = torch.tensor(1.0)
    assert faults.poison_loss(one) is one  # no file: untouched
    trigger.touch()
    monkeypatch.setenv("RANK", "1")
    assert faults.poison_loss(one) is one and trigger.exists()  # other ranks never look
    monkeypatch.setenv("RANK", "0")
    assert math.isnan(float(faults.poison_loss(one))) and not trigger.exists()
    assert faults.poison_loss(one) is one  # consumed: once


def test_a_nan_loss_skips_its_step_and_training_goes_on(tmp_path, monkeypatch) -> None:
    job = resolve(load_job(JOB))
    torch.manual_seed(0)
    engine = NativeEngine(build_model(job.spec.model), job, DistContext())
    data = build_train_data(job, 0, 1)
    trigger = tmp_path / "nan"
    monkeypatch.setenv("SEQTRAIN_FAULT_NAN_FILE", str(trigger))
    engine.step(data.next_step())
    before = {k: v.clone() for k, v in engine.state_module.state_dict().items()}
    trigger.touch()
    stats = engine.step(data.next_step())
    assert stats.skipped and not math.isfinite(stats.loss), stats
    after = engine.state_module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step left the weights as they were"
    stats = engine.step(data.next_step())
    assert not stats.skipped and math.isfinite(stats.loss)
    assert all(torch.isfinite(v).all() for v in engine.state_module.state_dict().values() if v.is_floating_point())
