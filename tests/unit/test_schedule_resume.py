"""Continuing a run with other training.steps (issue 42): the schedule is recomputed for the new total, and when
that moves the next step's learning rate the run refuses unless training.allowScheduleChange; either way it says
what happens at its start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from seqtrain.optim.build import lr_factor
from seqtrain.optim.schedules import steps_change
from seqtrain.runtime.exitcodes import InvalidConfig
from seqtrain.spec.training import ScheduleSpec, TrainingSpec
from seqtrain.train.loop import Trainer


def change(spec: ScheduleSpec, step: int, planned: int, total: int, allowed: bool = False) -> tuple[str, bool]:
    return steps_change(lambda s, t: lr_factor(s, spec, t), spec, 3e-3, step, planned, total, allowed)


def test_extending_a_finished_cosine_run_is_refused_naming_both_rates_and_the_switch() -> None:
    # the run: 60 steps to the floor (3.0e-4), then training.steps 700: step 61 would jump to ~3.0e-3
    msg, refuse = change(ScheduleSpec(name="cosine", warmup_steps=0), 60, 60, 700)
    assert refuse
    assert "3.00e-04" in msg and "training.allowScheduleChange: true" in msg and "step 61" in msg
    assert float(msg.split("becomes ")[1].split()[0]) == pytest.approx(3e-3 * lr_factor(60, ScheduleSpec(), 700), rel=1e-2)


def test_allowed_it_continues_and_says_so() -> None:
    msg, refuse = change(ScheduleSpec(name="cosine"), 60, 60, 700, allowed=True)
    assert not refuse and "recomputed for 700 steps" in msg and "becomes" in msg


def test_a_change_that_leaves_the_rate_alone_only_says_so() -> None:
    msg, refuse = change(ScheduleSpec(name="constant"), 60, 60, 700)
    assert not refuse and "stays 3.00e-03" in msg


def _trainer(steps: int, step: int, allowed: bool) -> SimpleNamespace:
    spec = SimpleNamespace(training=TrainingSpec(steps=steps, allow_schedule_change=allowed))
    logged: list[str] = []
    return SimpleNamespace(total_steps=steps, step=step, spec=spec, log=logged.append, logged=logged)


def test_the_trainer_refuses_at_resume_and_prints_when_allowed() -> None:
    t = _trainer(700, 60, allowed=False)
    with pytest.raises(InvalidConfig, match=r"^spec.training.steps: .*allowScheduleChange"):
        Trainer._check_steps_change(t, 60)  # type: ignore[arg-type]
    t = _trainer(700, 60, allowed=True)
    Trainer._check_steps_change(t, 60)  # type: ignore[arg-type]
    assert len(t.logged) == 1 and t.logged[0].startswith("seqtrain: training.steps is 700")
    t = _trainer(60, 30, allowed=False)  # same steps as the checkpoint: nothing to say
    Trainer._check_steps_change(t, 60)  # type: ignore[arg-type]
    assert t.logged == []
