"""Lost-time accounting (controller/lost_time.py), driven through decide() as a backend drives it: every figure of
status.lostSeconds, and productiveSeconds + lostSeconds == the wall time since creation == goodput's denominator."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

import jobs
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import CheckpointRef, JobStatus, Progress
from seqtrain_operator.controller import CreateGang, Observed, ReplicaObservation, decide, iso
from seqtrain_operator.controller.lost_time import REASONS, wall_seconds

T0 = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def make_job(*, gang: str = "native", suspend: bool = False) -> SeqTrainJob:
    sched = {"gang": gang, **({"queue": "team-a"} if gang == "kueue" else {})}
    return SeqTrainJob.model_validate(jobs.make_job(
        "t", replicas=2, suspend=suspend, training={"steps": 100, "globalBatchSize": 16},
        faultTolerance={"maxRestarts": 3, "backoffSeconds": 5}, scheduling=sched))


def gang(attempt: int, *phases: str, **kw: object) -> tuple[ReplicaObservation, ...]:
    return tuple(ReplicaObservation(replica=i, attempt=attempt, phase=ph, node=f"node-{i}",  # type: ignore[arg-type]
                                    **(kw if ph == "Failed" else {})) for i, ph in enumerate(phases))


def progress(attempt: int, step: int, last: float, began: float, saved: float = 0.0,
             step_s: float = 0.5) -> Progress:
    return Progress(step=step, updated_at=iso(at(last)), attempt=attempt, training_started_at=iso(at(began)),
                    checkpoint_seconds=saved, step_seconds=step_s)


class Backend:
    """The passes a backend makes: decide() on the persisted status, keep what it returns."""

    def __init__(self, job: SeqTrainJob, created: float | None = None) -> None:
        self.job, self.st = job, JobStatus()
        self.created = iso(at(created)) if created is not None else None

    def tick(self, t: float, replicas: tuple[ReplicaObservation, ...] = (), p: Progress | None = None,
             ckpt: int | None = None, job: SeqTrainJob | None = None) -> JobStatus:
        obs = Observed(replicas=replicas, progress=p, created=self.created,
                       latest_checkpoint=CheckpointRef(step=ckpt, path=f"/c/step-{ckpt}") if ckpt else None)
        self.st = decide(job or self.job, self.st, obs, at(t)).status
        return self.st

    def lost(self) -> dict[str, float]:
        assert self.st.lost_seconds is not None
        return {r: getattr(self.st.lost_seconds, r) for r in REASONS}


def test_a_run_with_one_crash_is_broken_down_by_reason_and_adds_up() -> None:
    b = Backend(make_job(), created=-20)
    b.tick(0)                                             # created 20 s ago: admitted now, gang created
    b.tick(5, gang(1, "Pending", "Pending"))
    b.tick(10, gang(1, "Running", "Running"))             # pods run; the trainer starts (imports, rendezvous)
    b.tick(30, gang(1, "Running", "Running"), progress(1, 10, last=30, began=25, saved=2.0))
    st = b.tick(60, gang(1, "Failed", "Failed", exit_code=137), progress(1, 40, last=55, began=25, saved=4.0),
                ckpt=30)
    assert st.phase == "Restarting" and st.steps_lost == [10]
    b.tick(66)                                            # backoff over: attempt 2 created
    assert b.st.attempt == 2
    b.tick(70, gang(2, "Running", "Running"))
    b.tick(80, gang(2, "Running", "Running"), progress(2, 38, last=80, began=76))
    st = b.tick(100, gang(2, "Succeeded", "Succeeded"), progress(2, 100, last=99, began=76, saved=1.0))
    assert st.phase == "Succeeded"
    assert b.lost() == pytest.approx({
        "queueing": 20,            # created until admitted
        "startup": 25,             # gang created until the trainer began its first step
        "restart": 21,             # last step before the failure (55) until attempt 2 trained (76)
        "recomputed": 5,           # 10 steps redone from checkpoint 30, at 0.5 s a step
        "checkpoint_stall": 5,     # 4 s in attempt 1, 1 s in attempt 2
        "suspended": 0})
    assert st.productive_seconds == pytest.approx(120 - 76)
    assert wall_seconds(st) == pytest.approx(120)         # creation to completion
    assert st.goodput == pytest.approx(44 / 120, abs=1e-4)
    b.tick(500, gang(2, "Succeeded", "Succeeded"))        # a finished job's clock has stopped
    assert wall_seconds(b.st) == pytest.approx(120) and b.st.goodput == pytest.approx(44 / 120, abs=1e-4)


def test_time_queued_in_an_external_scheduler_is_queueing_until_admitted() -> None:
    b = Backend(make_job(gang="kueue"), created=0)
    b.tick(0)
    b.tick(1, tuple(ReplicaObservation(i, 1, "Pending", queued=True) for i in range(2)))
    b.tick(40, tuple(ReplicaObservation(i, 1, "Pending", queued=True) for i in range(2)))
    b.tick(50, gang(1, "Pending", "Pending"))             # admitted: the pods start
    b.tick(60, gang(1, "Running", "Running"), progress(1, 1, last=60, began=58))
    # queued from the pass that saw the gang queued (t=1) until the pass that saw it admitted (t=50)
    assert b.lost()["queueing"] == pytest.approx(49) and b.lost()["startup"] == pytest.approx(1 + 8)
    assert b.st.productive_seconds == pytest.approx(2)


def test_a_hang_noticed_late_charges_the_time_since_the_last_step_to_restart() -> None:
    b = Backend(make_job())
    b.tick(0)
    b.tick(1, gang(1, "Running", "Running"), progress(1, 5, last=1, began=0, step_s=0.1))
    b.tick(20, gang(1, "Running", "Running"), progress(1, 5, last=1, began=0, step_s=0.1))  # no step since t=1
    st = b.tick(30, gang(1, "Failed", "Failed", exit_code=1), progress(1, 5, last=1, began=0, step_s=0.1))
    assert st.phase == "Restarting"
    # 19 s counted productive while the steps had stopped are moved to restart: training ended at its last step;
    # the 5 steps (no checkpoint) are redone
    assert b.lost()["restart"] == pytest.approx(29) and b.lost()["recomputed"] == pytest.approx(0.5)
    assert st.productive_seconds == pytest.approx(0.5)
    assert wall_seconds(st) == pytest.approx(30)


def test_suspended_time_is_its_own_reason_and_resuming_starts_up_again() -> None:
    job, off = make_job(), make_job(suspend=True)
    b = Backend(job)
    b.tick(0)
    b.tick(10, gang(1, "Running", "Running"), progress(1, 20, last=10, began=5))
    b.tick(12, gang(1, "Running", "Running"), progress(1, 22, last=12, began=5), job=off)
    assert b.st.phase == "Suspended"
    b.tick(15, (), progress(1, 22, last=12, began=5, saved=1.0), job=off)  # SIGTERM save of 1 s
    b.tick(100, (), job=off)
    b.tick(101, ())                                       # resumed: attempt 2 created
    b.tick(110, gang(2, "Running", "Running"), progress(2, 23, last=110, began=107))
    lost = b.lost()
    assert lost["suspended"] == pytest.approx(89) and lost["startup"] == pytest.approx(5 + 6)
    assert lost["checkpoint_stall"] == pytest.approx(1) and lost["restart"] == 0
    assert wall_seconds(b.st) == pytest.approx(110)


def test_a_stale_progress_of_the_previous_attempt_is_not_charged_twice() -> None:
    """A local run's progress.json still holds the last attempt's figures until the new trainer rewrites it."""
    b = Backend(make_job())
    b.tick(0)
    b.tick(10, gang(1, "Running", "Running"), progress(1, 20, last=10, began=2, saved=3.0))
    b.tick(15, gang(1, "Failed", "Running", exit_code=137), progress(1, 22, last=14, began=2, saved=3.0), ckpt=20)
    b.tick(40, gang(1, "Failed", "Failed", exit_code=137), progress(1, 22, last=14, began=2, saved=3.0), ckpt=20)
    assert b.st.phase == "Restarting"
    b.tick(46, (), progress(1, 22, last=14, began=2, saved=3.0), ckpt=20)
    b.tick(50, gang(2, "Running", "Running"), progress(1, 22, last=14, began=2, saved=3.0), ckpt=20)
    assert b.st.time_ledger is not None and b.st.time_ledger.state == "restart"  # attempt 1's progress: not trained
    b.tick(60, gang(2, "Running", "Running"), progress(2, 25, last=60, began=55, saved=0.0), ckpt=20)
    lost = b.lost()
    assert lost["checkpoint_stall"] == pytest.approx(3) and lost["recomputed"] == pytest.approx(1)
    assert lost["restart"] == pytest.approx(55 - 14)
    assert wall_seconds(b.st) == pytest.approx(60)


def test_a_status_from_before_the_accounting_starts_it_from_the_start_time() -> None:
    job = make_job()
    old = decide(job, JobStatus(), Observed(), T0).status
    old.time_ledger, old.lost_seconds, old.productive_seconds = None, None, None
    st = decide(job, old, Observed(replicas=gang(1, "Pending", "Pending")), at(30)).status
    assert st.lost_seconds is not None and st.lost_seconds.startup == pytest.approx(30)
    assert not any(isinstance(a, CreateGang) for a in decide(job, st, Observed(replicas=gang(1, "Pending")),
                                                                at(31)).actions)


def test_ranks_restarted_in_place_charge_restart_and_recomputed_without_a_new_attempt() -> None:
    """The pods stay (no Restarting phase, no new attempt): a new trainer process of the same attempt shows up in
    the progress with a later trainingStartedAt and its own save counter."""
    b = Backend(make_job())
    b.tick(0)
    b.tick(10, gang(1, "Running", "Running"), progress(1, 10, last=10, began=5, saved=1.0))
    b.tick(22, gang(1, "Running", "Running"), progress(1, 25, last=22, began=5, saved=1.0), ckpt=20)
    st = b.tick(40, gang(1, "Running", "Running"), progress(1, 27, last=38, began=35, saved=0.2), ckpt=20)
    assert st.phase == "Running" and st.attempt == 1
    assert b.lost() == pytest.approx({
        "queueing": 0, "startup": 5,
        "restart": 35 - 22,        # the old process's last step seen until the new one trained
        "recomputed": 5 * 0.5,     # steps 21..25 redone from checkpoint 20
        "checkpoint_stall": 1.2,   # the new process's counter starts from zero: 0.2 more, not 0.8 less
        "suspended": 0})
    assert wall_seconds(st) == pytest.approx(40)


def test_a_checkpoint_saved_in_the_grace_period_leaves_no_steps_to_redo_and_no_recomputed_time() -> None:
    """An evicted gang saves on SIGTERM after the eviction was seen: the failure's pass counted every step since the
    start (no checkpoint then) as lost; the new attempt resumes from the grace-period save, so none is redone and
    the time priced as recomputed was training after all (tests/integration/test_testbed_sigterm_save.py)."""
    b = Backend(make_job(), created=0)
    b.tick(0)
    b.tick(10, gang(1, "Running", "Running"), progress(1, 10, last=10, began=5))
    st = b.tick(30, gang(1, "Failed", "Failed", exit_code=137), progress(1, 40, last=25, began=5))
    assert st.steps_lost == [40] and b.lost()["recomputed"] == pytest.approx(20)  # 40 steps at 0.5 s
    st = b.tick(40, ckpt=40)  # the SIGTERM save of step 40, published; backoff over: attempt 2
    assert st.attempt == 2 and st.steps_lost == [0]
    assert b.lost()["recomputed"] == 0
    assert wall_seconds(st) == pytest.approx(40)  # still adds up to the wall time


def test_a_checkpoint_older_than_the_last_step_still_leaves_the_steps_after_it_to_redo() -> None:
    b = Backend(make_job(), created=0)
    b.tick(0)
    b.tick(10, gang(1, "Running", "Running"), progress(1, 10, last=10, began=5))
    b.tick(30, gang(1, "Failed", "Failed", exit_code=137), progress(1, 40, last=25, began=5))
    st = b.tick(40, ckpt=30)  # a checkpoint after the failure was seen, but 10 steps short of step 40
    assert st.attempt == 2 and st.steps_lost == [10]
    assert b.lost()["recomputed"] == pytest.approx(5)
    assert wall_seconds(st) == pytest.approx(40)


def test_the_new_attempt_says_it_resumed_from_a_save_the_operator_had_not_seen_and_nothing_is_redone() -> None:
    """The gang was re-created "from scratch" (the SIGTERM save was published after the operator last looked): the
    new attempt's first report says it resumed from step 40 having reached 40, so no step is redone after all."""
    b = Backend(make_job(), created=0)
    b.tick(0)
    b.tick(10, gang(1, "Running", "Running"), progress(1, 10, last=10, began=5))
    b.tick(30, gang(1, "Failed", "Failed", exit_code=137), progress(1, 40, last=25, began=5))
    st = b.tick(40)  # backoff over: attempt 2, from scratch as far as the operator knows
    assert st.attempt == 2 and st.steps_lost == [40] and b.lost()["recomputed"] == pytest.approx(20)
    p = progress(2, 40, last=46, began=45)
    p.step_reached_before, p.resumed_from = 40, 40
    st = b.tick(50, gang(2, "Running", "Running"), p)
    assert st.steps_lost == [0] and b.lost()["recomputed"] == 0
    assert wall_seconds(st) == pytest.approx(50)
