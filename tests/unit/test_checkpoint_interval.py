"""checkpoint.intervalSteps: auto / intervalSeconds: the Young/Daly math, the MTBF estimate, rank 0's policy, the
spec's checks, and the controller's share (failure history out, status.checkpointPolicy / workAtRisk in)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from seqtrain.spec import SpecError, load_job
from seqtrain.spec.status import CheckpointPolicy, CheckpointRef, JobStatus, WorkAtRisk
from seqtrain.train.interval import (
    DEFAULT_RANK_MTBF_HOURS,
    WARMUP_STEPS,
    IntervalPolicy,
    gang_mtbf,
    interval_steps,
    young_daly_seconds,
)
from seqtrain_operator.controller import Observed, decide
from seqtrain_operator.controller.checkpoint_policy import checkpoint_report, failure_history, record

HEAD = "apiVersion: seqtrain.dev/v1alpha1\nkind: SeqTrainJob\nmetadata: {name: j}\n"
NOW = datetime(2026, 11, 25, 12, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(("save", "mtbf", "want"), [
    (10.0, 3600.0, math.sqrt(2 * 10 * 3600) - 10),  # Daly: sqrt(2 delta M) - delta
    (1.0, 50.0, 9.0),                               # sqrt(100) - 1
    (100.0, 50.0, 50.0),                            # delta >= 2M: checkpoint every MTBF
    (0.0, 3600.0, 0.0),                             # a free save: every step
])
def test_young_daly(save: float, mtbf: float, want: float) -> None:
    assert young_daly_seconds(save, mtbf) == pytest.approx(want)


def test_a_costlier_save_or_a_steadier_gang_checkpoints_less_often() -> None:
    assert young_daly_seconds(4.0, 3600) > young_daly_seconds(1.0, 3600)
    assert young_daly_seconds(1.0, 7200) > young_daly_seconds(1.0, 3600)


@pytest.mark.parametrize(("failures", "exposure", "ranks", "want", "source"), [
    (0, 0.0, 1, DEFAULT_RANK_MTBF_HOURS * 3600, "prior"),
    (0, 0.0, 16384, DEFAULT_RANK_MTBF_HOURS * 3600 / 16384, "prior"),  # any rank's failure stops the gang
    (0, 500.0, 8, DEFAULT_RANK_MTBF_HOURS * 3600 / 8 + 500.0, "prior"),  # failure-free time adds to it
    (4, 200.0, 8, 50.0, "measured"),  # the job's own rate, whatever the prior said
])
def test_gang_mtbf(failures: int, exposure: float, ranks: int, want: float, source: str) -> None:
    assert gang_mtbf(failures, exposure, DEFAULT_RANK_MTBF_HOURS, ranks) == (pytest.approx(want), source)


@pytest.mark.parametrize(("lo", "hi", "want"), [
    (1, None, (90, "youngDaly")),  # tau 9 s / 0.1 s per step
    (100, None, (100, "minIntervalSteps")),
    (1, 40, (40, "maxIntervalSteps")),
])
def test_interval_steps_within_bounds(lo: int, hi: int | None, want: tuple[int, str]) -> None:
    assert interval_steps(1.0, 50.0, 0.1, lo, hi) == want


def test_auto_saves_early_to_measure_then_follows_the_measurements() -> None:
    p = IntervalPolicy(ranks=2, failures=3, earlier_running_s=150.0)
    for _ in range(WARMUP_STEPS):
        p.observe_step(0.1)
    assert p.recompute(0.0) is None  # no save measured yet
    assert not p.due(WARMUP_STEPS - 1, WARMUP_STEPS - 1, 1.0) and p.due(WARMUP_STEPS, WARMUP_STEPS, 1.0)
    p.observe_save(1.0)
    assert p.recompute(0.0) == 90  # MTBF 150 s / 3 = 50 s: tau = sqrt(2 x 1 x 50) - 1 = 9 s = 90 steps
    assert not p.due(100, 89, 9.0) and p.due(101, 90, 9.0)
    rep = p.report()
    assert rep["intervalSteps"] == 90 and rep["saveSeconds"] == 1.0 and rep["mtbfSeconds"] == 50.0
    assert rep["sources"] == {"intervalSteps": "youngDaly", "saveSeconds": "measured", "mtbfSeconds": "measured"}
    p.observe_save(4.0)  # the storage got slower: save less often
    assert p.recompute(0.0) > 90


def test_fixed_steps_and_seconds_are_the_users() -> None:
    steps = IntervalPolicy(fixed_steps=10)
    assert steps.recompute(0.0) == 10 and steps.report()["sources"]["intervalSteps"] == "user"
    assert steps.due(20, 3, 0.0) and not steps.due(21, 1, 0.0)  # multiples of N, as before
    secs = IntervalPolicy(fixed_seconds=30.0)
    secs.observe_step(0.5)
    assert secs.recompute(0.0) == 60 and secs.report()["intervalSeconds"] == 30.0
    assert not secs.due(7, 7, 29.9) and secs.due(8, 8, 30.0)


def _spec_problems(checkpoint: str) -> list[str]:
    try:
        load_job(HEAD + f"spec:\n  checkpoint: {checkpoint}\n")
    except SpecError as err:
        return [str(p) for p in err.problems]
    return []


@pytest.mark.parametrize(("checkpoint", "problem"), [
    ("{intervalSteps: often}", "spec.checkpoint.intervalSteps: 'often' is neither a number of steps nor 'auto'"),
    ("{intervalSteps: 0}", "spec.checkpoint.intervalSteps: 0 must be between 1 and"),
    ("{intervalSteps: true}", "spec.checkpoint.intervalSteps: expected an integer, not a boolean"),
    ("{intervalSteps: 10, intervalSeconds: 60}", "intervalSteps (10) and intervalSeconds (60) both set"),
    ("{intervalSeconds: 0}", "spec.checkpoint.intervalSeconds"),
    ("{intervalSteps: auto, minIntervalSteps: 50, maxIntervalSteps: 5}", "maxIntervalSteps (5) is below "
     "minIntervalSteps (50)"),
])
def test_bad_intervals_name_the_field(checkpoint: str, problem: str) -> None:
    problems = _spec_problems(checkpoint)
    assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize(("checkpoint", "steps", "fixed"), [
    ("{}", None, 50), ("{intervalSteps: 7}", 7, 7), ("{intervalSteps: auto}", "auto", None),
    ("{intervalSeconds: 90}", None, None),
])
def test_good_intervals(checkpoint: str, steps: object, fixed: int | None) -> None:
    ck = load_job(HEAD + f"spec:\n  checkpoint: {checkpoint}\n").spec.checkpoint
    assert ck.interval_steps == steps and ck.fixed_steps == fixed


def test_failure_history_counts_every_restart_over_the_running_time() -> None:
    st = JobStatus(restarts=2, infra_restarts=1, running_seconds=90.0)
    h = failure_history(st, 1000.0)
    assert (h.failures, h.running_seconds, h.rank_mtbf_hours) == (3, 90.0, 1000.0)


def test_checkpoint_report_and_age() -> None:
    policy, risk = checkpoint_report({"checkpointPolicy": {"intervalSteps": 9, "mtbfSeconds": 50.0},
                                      "workAtRisk": {"checkpointStep": 20, "steps": 4, "seconds": 1.5}})
    assert policy == CheckpointPolicy(interval_steps=9, mtbf_seconds=50.0)
    st = JobStatus(last_checkpoint=CheckpointRef(step=20, path="/c/step-20",
                                                 time=(NOW - timedelta(seconds=42)).strftime("%Y-%m-%dT%H:%M:%SZ")))
    record(st, policy, risk, NOW)
    assert st.checkpoint_policy.interval_steps == 9
    assert st.work_at_risk == WorkAtRisk(checkpoint_step=20, steps=4, seconds=1.5, checkpoint_age_seconds=42.0)
    record(st, None, None, NOW + timedelta(seconds=8))  # no trainer answers (restarting): the checkpoint still ages
    assert st.work_at_risk.checkpoint_age_seconds == 50.0 and st.checkpoint_policy.interval_steps == 9


def test_decide_puts_the_trainers_report_in_status() -> None:
    job = load_job(HEAD + "spec:\n  checkpoint: {intervalSteps: auto}\n")
    policy, risk = checkpoint_report({"checkpointPolicy": {"intervalSteps": 9, "sources": {"intervalSteps":
                                      "youngDaly"}}, "workAtRisk": {"checkpointStep": 0, "steps": 3, "seconds": 1.0}})
    d = decide(job, JobStatus(), Observed(checkpoint_policy=policy, work_at_risk=risk), NOW)
    out = d.status.to_dict()
    assert out["checkpointPolicy"]["intervalSteps"] == 9 and out["workAtRisk"]["steps"] == 3


def test_every_attempt_is_told_the_jobs_failures_in_its_trainer_config() -> None:
    import json

    from seqtrain.spec import TrainerConfig
    from seqtrain_operator.k8s.owner import Owner
    from seqtrain_operator.k8s.pods import manifests as m

    job = load_job(HEAD + "spec:\n  checkpoint: {intervalSteps: auto}\n")
    owner = Owner(name="j", namespace="ns", uid="u-1")
    settings = m.Settings(rank_mtbf_hours=2000.0)
    history = failure_history(JobStatus(restarts=1, infra_restarts=2, running_seconds=42.5), settings.rank_mtbf_hours)
    gang = m.build_gang(job, owner, 4, settings, None, history=history)
    cfg = TrainerConfig.model_validate(json.loads(gang.configmap["data"][m.CONFIG_FILE]))
    assert cfg.runtime.failure_history.failures == 3 and cfg.runtime.failure_history.running_seconds == 42.5
    assert cfg.runtime.failure_history.rank_mtbf_hours == 2000.0
    first = TrainerConfig.model_validate(json.loads(m.build_configmap(job, owner, 1, settings)["data"][m.CONFIG_FILE]))
    assert first.runtime.failure_history.failures == 0 and first.runtime.failure_history.rank_mtbf_hours == 2000.0


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf"])
def test_a_bad_local_prior_is_refused_before_anything_runs(value: str, tmp_path, monkeypatch, capsys) -> None:
    from seqtrain_operator.local.runner import RANK_MTBF_ENV, run_file

    job = tmp_path / "job.yaml"
    job.write_text(HEAD + "spec:\n  checkpoint: {intervalSteps: auto}\n")
    monkeypatch.setenv(RANK_MTBF_ENV, value)
    assert run_file(str(job), str(tmp_path / "run")) == 2
    assert f"{RANK_MTBF_ENV}='{value}': must be a positive number of hours" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
