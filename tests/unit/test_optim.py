"""Parameter groups, learning-rate schedules, and the global-batch loss normalisation of the native engine."""

from __future__ import annotations

import math

import pytest
import torch

from seqtrain.data import IGNORE_INDEX, Batch
from seqtrain.engine import NativeEngine
from seqtrain.models import build_model
from seqtrain.optim.build import build_optimizer, build_scheduler, lr_factor, param_groups
from seqtrain.runtime.dist import DistContext
from seqtrain.spec import load_job, resolve
from seqtrain.spec.training import OptimizerSpec, ScheduleSpec

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: optim}
spec:
  model: {arch: gpt, preset: tiny, dim: 32, heads: 2, ffnDim: 64, tieEmbeddings: false}
  data: {seqLen: 16}
  training: {steps: 10, globalBatchSize: 4, microBatchSize: 2, gradClip: null}
"""


def job(*overrides: str):  # noqa: ANN201
    return resolve(load_job(JOB, list(overrides)))


def test_weight_decay_skips_norms_and_embeddings_get_their_lr_scale() -> None:
    model = build_model(job().spec.model)
    spec = OptimizerSpec(lr=0.01, weight_decay=0.1, embedding_lr_scale=2.0)
    groups = {g["name"]: g for g in param_groups(model, spec)}
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert no_decay and all(n.endswith("norm.weight") for n in no_decay)
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert {names[id(p)] for p in groups["embed"]["params"]} == {"embed.weight"}
    assert groups["embed"]["lr"] == pytest.approx(0.02)
    assert "lm_head.weight" in {names[id(p)] for p in groups["decay"]["params"]}
    assert groups["decay"]["weight_decay"] == 0.1
    every = [id(p) for g in groups.values() for p in g["params"]]
    assert sorted(every) == sorted(id(p) for p in model.parameters())  # each parameter exactly once


def test_warmup_then_cosine_down_to_the_floor() -> None:
    spec = ScheduleSpec(name="cosine", warmup_steps=4, min_lr_ratio=0.1)
    f = [lr_factor(s, spec, 20) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False))
    assert f[(4 + 19) // 2] == pytest.approx(0.55, abs=0.05)  # halfway through the decay: midpoint
    const = ScheduleSpec(name="constant", warmup_steps=2)
    assert [lr_factor(s, const, 10) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(0, ScheduleSpec(name="cosine"), 1) == 1.0  # one step, no warmup: peak


def test_scheduler_state_restores_the_learning_rate() -> None:
    model = build_model(job().spec.model)
    spec = ScheduleSpec(name="cosine", warmup_steps=2)
    opt = build_optimizer(model, OptimizerSpec(lr=0.1))
    sched = build_scheduler(opt, spec, 10)
    for _ in range(5):
        opt.step()
        sched.step()
    opt2 = build_optimizer(model, OptimizerSpec(lr=0.1))
    sched2 = build_scheduler(opt2, spec, 10)
    sched2.load_state_dict(sched.state_dict())
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert sched.get_last_lr()[0] == pytest.approx(0.1 * lr_factor(5, spec, 10))


def batch(seed: int, pad: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    targets = torch.randint(0, 256, (2, 16), generator=g)
    if pad:
        targets[0, -pad:] = IGNORE_INDEX
    return Batch(tokens=tokens, targets=targets)


def engine_grads(micro_batches: list[Batch]):  # noqa: ANN201
    torch.manual_seed(0)
    j = job()
    model = build_model(j.spec.model)
    engine = NativeEngine(model, j, DistContext())
    engine.optimizer.zero_grad = lambda set_to_none=True: None  # keep the gradients for inspection
    engine.optimizer.step = lambda closure=None: None
    stats = engine.step(micro_batches)
    return stats, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_accumulation_gives_the_gradient_of_one_big_batch() -> None:
    """Loss SUM per micro-batch / target tokens of the whole batch: padding-uneven micro-batches included."""
    b1, b2 = batch(1, pad=11), batch(2)
    split_stats, split = engine_grads([b1, b2])
    big = Batch(tokens=torch.cat([b1.tokens, b2.tokens]), targets=torch.cat([b1.targets, b2.targets]))
    one_stats, one = engine_grads([big])
    assert split_stats.target_tokens == one_stats.target_tokens == 64 - 11
    assert split_stats.slots == 64
    assert split_stats.loss == pytest.approx(one_stats.loss, rel=1e-6)
    assert split_stats.loss == pytest.approx(math.log(256), rel=0.05)  # untrained: about uniform
    for name in one:
        torch.testing.assert_close(split[name], one[name], rtol=1e-5, atol=1e-7, msg=name)


def test_resume_with_more_steps_uses_the_new_schedule_from_the_first_step() -> None:
    """A checkpoint taken under steps=10 and resumed under steps=40 continues on the steps=40 cosine curve."""
    torch.manual_seed(0)
    short = job("training.schedule.warmupSteps=2")
    engine = NativeEngine(build_model(short.spec.model), short, DistContext())
    for s in range(5):
        engine.step([batch(s)])
    state = engine.state_dict()

    longer = job("training.steps=40", "training.schedule.warmupSteps=2")
    resumed = NativeEngine(build_model(longer.spec.model), longer, DistContext())
    resumed.load_state_dict(state)
    expected = longer.spec.training.optimizer.lr * lr_factor(5, longer.spec.training.schedule, 40)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert expected != pytest.approx(engine.optimizer.param_groups[0]["lr"])  # the two curves differ here

    # the same schedule resumes to exactly the same rate (bit-exact resume is untouched)
    same = NativeEngine(build_model(short.spec.model), short, DistContext())
    same.load_state_dict(state)
    assert [g["lr"] for g in same.optimizer.param_groups] == [g["lr"] for g in engine.optimizer.param_groups]
