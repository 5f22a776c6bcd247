"""Controller core: table tests per situation, and hypothesis properties over random event sequences."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import jobs
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import CheckpointRef, JobStatus, Progress
from seqtrain_operator.controller import (
    CreateGang,
    DeleteGang,
    Event,
    Observed,
    ReplicaObservation,
    RequeueAfter,
    backoff_seconds,
    decide,
    iso,
    parse,
)
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller.failure_policy import FailureClass, classify, root_cause
from seqtrain_operator.controller.lost_time import wall_seconds
from seqtrain_operator.planner.types import Node

T0 = datetime(2026, 11, 22, 12, 0, 0, tzinfo=timezone.utc)


# ---- builders -----------------------------------------------------------------------------------------------------


def make_job(replicas: int = 2, *, max_restarts: int = 2, max_infra: int = 3, backoff: float = 5.0,
             max_backoff: float = 300.0, hang: int | None = None, suspend: bool = False,
             sched_timeout: int | None = None, pending_grace: int = 300, in_place: int = 0) -> SeqTrainJob:
    """in_place: faultTolerance.inPlaceRestarts, 0 here so a gang's launchers give up at once (a replica Failed)."""
    return SeqTrainJob.model_validate(jobs.make_job(
        "t", replicas=replicas, suspend=suspend, training={"steps": 100, "globalBatchSize": 8 * replicas},
        faultTolerance={"maxRestarts": max_restarts, "maxInfraRestarts": max_infra, "backoffSeconds": backoff,
                        "maxBackoffSeconds": max_backoff, "hangTimeoutSeconds": hang, "inPlaceRestarts": in_place},
        scheduling={"timeoutSeconds": sched_timeout, "pendingGraceSeconds": pending_grace}))


def gang(attempt: int, *phases: str, **failed: object) -> tuple[ReplicaObservation, ...]:
    """gang(1, "Running", "Failed", exit_code=137) -> replica 0 Running, replica 1 Failed with the given fields.
    "Pending": not placed on a node (kube-scheduler could not); "Starting": Pending on node-<i> (ContainerCreating)."""
    out = []
    for i, ph in enumerate(phases):
        extra = failed if ph == "Failed" else {}
        node = None if ph == "Pending" else f"node-{i}"
        out.append(ReplicaObservation(replica=i, attempt=attempt, phase="Pending" if ph == "Starting" else ph,  # type: ignore[arg-type]
                                      node=node, **extra))
    return tuple(out)


def status(phase: str = "Pending", **kw: object) -> JobStatus:
    return JobStatus(phase=phase, **kw)  # type: ignore[arg-type]


def ck(step: int) -> CheckpointRef:
    return CheckpointRef(step=step, path=f"/ckpt/step-{step}")


def run_to_running(job: SeqTrainJob) -> JobStatus:
    st = decide(job, JobStatus(), Observed(), T0).status
    return decide(job, st, Observed(replicas=gang(1, *["Running"] * job.spec.replicas)), T0).status


# ---- table tests --------------------------------------------------------------------------------------------------


def test_new_job_creates_the_whole_gang_once() -> None:
    d = decide(make_job(), JobStatus(), Observed(), T0)
    assert d.of(CreateGang) == [CreateGang(attempt=1, resume_from_step=None)]
    assert d.status.phase == "Scheduling" and d.status.attempt == 1
    assert d.status.start_time == iso(T0)
    assert d.status.world_size == 2


def test_new_job_with_checkpoint_resumes_from_it() -> None:
    d = decide(make_job(), JobStatus(), Observed(latest_checkpoint=ck(40)), T0)
    assert d.of(CreateGang) == [CreateGang(attempt=1, resume_from_step=40)]
    assert d.status.last_checkpoint is not None and d.status.last_checkpoint.step == 40


def test_created_gang_not_yet_observed_is_recreated_with_the_same_attempt() -> None:
    job = make_job()
    st = decide(job, JobStatus(), Observed(), T0).status
    d = decide(job, st, Observed(), T0 + timedelta(seconds=1))
    assert d.of(CreateGang) == [CreateGang(attempt=1, resume_from_step=None)]
    assert d.status.attempt == 1


def test_all_replicas_running_enters_running_with_placement() -> None:
    st = run_to_running(make_job())
    assert st.phase == "Running"
    assert [(p.replica, p.node, p.ranks) for p in st.placement] == [(0, "node-0", [0]), (1, "node-1", [1])]
    assert any(c.type == "Running" and c.status == "True" for c in st.conditions)


def test_partial_gang_stays_scheduling() -> None:
    job = make_job()
    st = decide(job, JobStatus(), Observed(), T0).status
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Pending")), T0 + timedelta(seconds=10))
    assert d.status.phase == "Scheduling" and not d.of(CreateGang) and not d.of(DeleteGang)


def test_pending_longer_than_grace_tears_the_gang_down() -> None:
    job = make_job(pending_grace=60)
    st = decide(job, JobStatus(), Observed(), T0).status
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Pending")), T0 + timedelta(seconds=61))
    assert d.of(DeleteGang) == [DeleteGang(1, "PendingTimeout")]
    assert d.status.restarts == 0


def test_a_replica_deleted_before_the_gang_ran_is_replanned_after_the_grace() -> None:
    """The chaos soak (seed 41): an evicted pod of a Scheduling gang whose other replica runs was never re-created
    and never counted as a failure, so the gang waited in Scheduling for good. Absent replicas count as stuck: past
    scheduling.pendingGraceSeconds the gang is torn down and re-planned; before it, the gang waits (a creation may
    still be on its way to the mirror)."""
    job = make_job(pending_grace=60)
    st = decide(job, JobStatus(), Observed(), T0).status
    one_left = gang(1, "Running")  # replica 1 of 2 is gone
    early = decide(job, st, Observed(replicas=one_left), T0 + timedelta(seconds=30))
    assert early.status.phase == "Scheduling" and not early.of(DeleteGang) and not early.of(CreateGang)
    assert early.of(RequeueAfter)[0].seconds <= 30  # it looks again at the grace's end, not a poll later
    late = decide(job, early.status, Observed(replicas=one_left), T0 + timedelta(seconds=61))
    assert late.of(DeleteGang) == [DeleteGang(1, "PendingTimeout")]
    assert "absent (replica 1's pod is gone)" in cond.get(late.status, "Scheduled").message
    assert late.status.restarts == 0 and late.status.infra_restarts == 0


@pytest.mark.parametrize(("exit_code", "reason", "klass"), [
    (137, None, FailureClass.USER),
    (1, None, FailureClass.USER),
    (4, None, FailureClass.USER),
    (137, "OOMKilled", FailureClass.USER),
    (3, None, FailureClass.PERMANENT),
    (None, "InvalidImageName", FailureClass.PERMANENT),
    (None, "OutOfnvidia.com/gpu", FailureClass.INFRASTRUCTURE),
    (None, "OutOfpods", FailureClass.INFRASTRUCTURE),
    (None, "UnexpectedAdmissionError", FailureClass.INFRASTRUCTURE),
    (None, "NodeAffinity", FailureClass.INFRASTRUCTURE),
    (5, None, FailureClass.INFRASTRUCTURE),
    (143, "Evicted", FailureClass.DISRUPTION),
    (None, "NodeLost", FailureClass.INFRASTRUCTURE),
    (137, "Preempted", FailureClass.DISRUPTION),
    (143, "NodeShutdown", FailureClass.DISRUPTION),
])
def test_failure_classification(exit_code: int | None, reason: str | None, klass: FailureClass) -> None:
    r = ReplicaObservation(replica=0, attempt=1, phase="Failed", exit_code=exit_code, reason=reason)
    assert classify(r).cls is klass


def test_oom_is_the_users_with_the_reason_and_the_fix_in_status() -> None:
    job = make_job()
    d = decide(job, run_to_running(job), Observed(replicas=gang(1, "Running", "Failed", exit_code=137,
                                                                reason="OOMKilled")), T0)
    assert d.status.restarts == 1 and d.status.infra_restarts == 0 and d.status.failed_nodes == {}
    restarting = next(c for c in d.status.conditions if c.type == "Restarting")
    assert restarting.reason == "OOMKilled" and "spec.resources.memory" in restarting.message


@pytest.mark.parametrize(("exit_code", "reason", "why"), [
    (5, None, "GPUUnavailable"), (None, "OutOfnvidia.com/gpu", "KubeletRejected"),
    (None, "UnexpectedAdmissionError", "KubeletRejected")])
def test_node_faults_are_infrastructure_and_avoid_the_node(exit_code: int | None, reason: str | None,
                                                           why: str) -> None:
    job = make_job(max_restarts=0)
    d = decide(job, run_to_running(job), Observed(replicas=gang(1, "Running", "Failed", exit_code=exit_code,
                                                                reason=reason)), T0)
    assert d.status.phase == "Restarting" and d.status.infra_restarts == 1 and d.status.restarts == 0
    assert "node-1" in d.status.failed_nodes and d.status.message.startswith("replica 1 on node-1")
    assert next(c for c in d.status.conditions if c.type == "Restarting").reason == why


def test_failing_image_pull_is_transient_with_its_own_deadline() -> None:
    job = make_job(pending_grace=60)  # imagePullTimeoutSeconds defaults to 900
    st = decide(job, JobStatus(), Observed(), T0).status
    pulling = (ReplicaObservation(0, 1, "Running", node="node-0"),
               ReplicaObservation(1, 1, "Pending", reason="ImagePullBackOff", node="node-1",
                                  message="Back-off pulling image"))
    d = decide(job, st, Observed(replicas=pulling), T0 + timedelta(seconds=600))  # past the pending grace
    assert not d.of(DeleteGang) and d.status.phase == "Scheduling" and "ImagePullBackOff" in d.status.message
    assert d.status.restarts == 0
    d = decide(job, d.status, Observed(replicas=pulling), T0 + timedelta(seconds=901))
    assert d.status.phase == "Failed" and d.of(DeleteGang)
    assert "imagePullTimeoutSeconds" in d.status.message and "Back-off pulling image" in d.status.message


def test_root_cause_prefers_the_cause_over_its_echo() -> None:
    echo = ReplicaObservation(0, 1, "Failed", exit_code=4)
    oom = ReplicaObservation(1, 1, "Failed", exit_code=137, reason="OOMKilled")
    lost = ReplicaObservation(2, 1, "Failed", exit_code=1, reason="NodeLost", node="n2")
    assert root_cause([echo, oom]).reason == "OOMKilled"  # type: ignore[union-attr]
    assert root_cause([echo, oom, lost]).reason == "NodeLost"  # type: ignore[union-attr]
    assert root_cause([ReplicaObservation(0, 1, "Running")]) is None


def test_rank_failure_deletes_gang_and_schedules_restart_with_backoff() -> None:
    job = make_job(backoff=5)
    st = run_to_running(job)
    st.progress = Progress(step=47)
    now = T0 + timedelta(minutes=3)
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Failed", exit_code=137), latest_checkpoint=ck(40)), now)
    assert d.of(DeleteGang) == [DeleteGang(1, "RankFailed")]
    assert not d.of(CreateGang)
    assert d.status.phase == "Restarting" and d.status.restarts == 1
    assert d.of(RequeueAfter) == [RequeueAfter(5.0)]
    assert parse(d.status.next_restart_time) == now + timedelta(seconds=5)
    assert d.status.steps_lost == [7]
    assert "SIGKILL" in d.status.message and "restart 1/2" in d.status.message
    assert any(e.type == "Warning" for e in d.of(Event))


def test_restarting_waits_for_the_dying_gang_then_for_the_backoff_then_recreates() -> None:
    job = make_job(backoff=5)
    st = run_to_running(job)
    failed = gang(1, "Running", "Failed", exit_code=1)
    st = decide(job, st, Observed(replicas=failed), T0).status
    # the old gang is still being deleted: delete again, never create
    d = decide(job, st, Observed(replicas=failed), T0 + timedelta(seconds=10))
    assert d.of(DeleteGang) and not d.of(CreateGang)
    # gone, but the backoff has not passed
    d = decide(job, st, Observed(), T0 + timedelta(seconds=2))
    assert not d.of(CreateGang) and d.of(RequeueAfter) == [RequeueAfter(3.0)]
    # gone and due: a new incarnation, resuming from the checkpoint
    d = decide(job, st, Observed(latest_checkpoint=ck(20)), T0 + timedelta(seconds=5))
    assert d.of(CreateGang) == [CreateGang(attempt=2, resume_from_step=20)]
    assert d.status.phase == "Scheduling" and d.status.restarts == 1
    assert [e.reason for e in d.of(Event)] == ["Restarted"]


def test_max_restarts_reached_fails_the_job() -> None:
    job = make_job(max_restarts=1)
    st = run_to_running(job)
    st.restarts = 1
    d = decide(job, st, Observed(replicas=gang(1, "Failed", "Running", exit_code=1)), T0)
    assert d.status.phase == "Failed" and d.status.restarts == 1
    assert "maxRestarts (1) reached" in d.status.message
    assert d.of(DeleteGang) and not d.of(CreateGang)
    assert d.status.completion_time == iso(T0)


def test_zero_max_restarts_fails_on_first_failure() -> None:
    job = make_job(max_restarts=0)
    d = decide(job, run_to_running(job), Observed(replicas=gang(1, "Failed", "Running", exit_code=1)), T0)
    assert d.status.phase == "Failed" and d.status.restarts == 0


def _fail_attempt(job: SeqTrainJob, st: JobStatus, now: datetime, error: str | None, progress_at: datetime | None,
                  exit_code: int = 1) -> JobStatus:
    """Create the next attempt at `now`, then see it fail (with `error`) 60s later; progress stamped at
    `progress_at` (None: no step ever)."""
    st = decide(job, st, Observed(), now).status
    assert st.phase == "Scheduling"
    if progress_at is not None:
        st.progress = Progress(step=5, updated_at=iso(progress_at))
    return decide(job, st, Observed(replicas=gang(st.attempt, "Failed", exit_code=exit_code, error=error)),
                  now + timedelta(seconds=60)).status


DS_ERROR = "AssertionError: Distributed backend is not initialized on port 29{n}"


@pytest.mark.parametrize("case, errors, stepped, phases", [
    # the same error before the first step twice: the second ends the job, budget (5) left unused
    ("same-error-twice", [DS_ERROR.format(n=1), DS_ERROR.format(n=7)], [False, False], ["Restarting", "Failed"]),
    ("different-errors", ["OSError: disk full", "ValueError: bad shard"], [False, False],
     ["Restarting", "Restarting"]),
    ("no-error-line (SIGKILL, OOM)", [None, None], [False, False], ["Restarting", "Restarting"]),
    ("trained-then-failed", ["RuntimeError: x", "RuntimeError: x"], [True, True], ["Restarting", "Restarting"]),
    ("start-up failure after a trained attempt", ["RuntimeError: x", "RuntimeError: x"], [True, False],
     ["Restarting", "Restarting"]),
])
def test_identical_failure_before_the_first_step_is_not_retried(case: str, errors: list, stepped: list,
                                                                 phases: list) -> None:
    job = make_job(replicas=1, max_restarts=5, backoff=0)
    st, now, seen = JobStatus(), T0, []
    for err, step in zip(errors, stepped, strict=True):
        st = _fail_attempt(job, st, now, err, now + timedelta(seconds=30) if step else None)
        seen.append(st.phase)
        now += timedelta(minutes=5)
    assert seen == phases, case
    if phases[-1] == "Failed":
        assert st.conditions and any(c.type == "Failed" and c.reason == "StartupFailure" for c in st.conditions)
        assert "deterministic start-up failure" in st.message and "not initialized" in st.message
        assert st.restarts == 1


def test_a_different_exit_code_is_a_different_failure() -> None:
    job = make_job(replicas=1, max_restarts=5, backoff=0)
    st = _fail_attempt(job, JobStatus(), T0, "RuntimeError: x", None, exit_code=1)
    st = _fail_attempt(job, st, T0 + timedelta(minutes=5), "RuntimeError: x", None, exit_code=4)
    assert st.phase == "Restarting"


def test_progress_of_an_earlier_attempt_does_not_count_as_a_step() -> None:
    job = make_job(replicas=1, max_restarts=5, backoff=0)
    st = _fail_attempt(job, JobStatus(), T0, "RuntimeError: x", T0 + timedelta(seconds=30))  # trained, then failed
    st = _fail_attempt(job, st, T0 + timedelta(minutes=5), "RuntimeError: y", T0 + timedelta(seconds=30))
    st = _fail_attempt(job, st, T0 + timedelta(minutes=10), "RuntimeError: y", T0 + timedelta(seconds=30))
    assert st.phase == "Failed" and "StartupFailure" in [c.reason for c in st.conditions]


def test_permanent_failure_fails_without_restart() -> None:
    job = make_job()
    d = decide(job, run_to_running(job), Observed(replicas=gang(1, "Failed", "Failed", exit_code=3)), T0)
    assert d.status.phase == "Failed" and d.status.restarts == 0
    assert "permanent" in d.status.message


def test_infrastructure_failure_uses_its_own_budget_and_avoids_the_node() -> None:
    job = make_job(max_restarts=0)
    st = run_to_running(job)
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Failed", exit_code=5)), T0)  # no CUDA device
    assert d.status.phase == "Restarting" and d.status.restarts == 0 and d.status.infra_restarts == 1
    assert "node-1" in d.status.failed_nodes
    d2 = decide(job, d.status, Observed(), T0 + timedelta(seconds=10))
    assert d2.of(CreateGang) == [CreateGang(attempt=2, resume_from_step=None, avoid_nodes=("node-1",))]
    # after nodeAvoidSeconds (600) the node is usable again
    d3 = decide(job, d.status, Observed(), T0 + timedelta(seconds=601))
    assert d3.of(CreateGang)[0].avoid_nodes == ()


def lost(replica: int, attempt: int = 1, *, terminating: bool = True) -> ReplicaObservation:
    """A replica whose node died: NotReady past the grace, its pod stuck with a deletionTimestamp."""
    return ReplicaObservation(replica=replica, attempt=attempt, phase="Failed", reason="NodeLost",
                              node=f"node-{replica}", terminating=terminating, node_lost=True)


def test_dead_node_force_deletes_charges_infrastructure_avoids_the_node_and_restarts() -> None:
    job = make_job(max_restarts=0)
    st = run_to_running(job)
    alive = ReplicaObservation(replica=0, attempt=1, phase="Running", node="node-0")
    d = decide(job, st, Observed(replicas=(alive, lost(1, terminating=False))), T0)
    assert d.of(DeleteGang) == [DeleteGang(1, "NodeLost", force_nodes=("node-1",))]
    assert d.status.phase == "Restarting" and d.status.infra_restarts == 1 and d.status.restarts == 0
    assert "node-1" in d.status.failed_nodes
    # The pod on the dead node keeps its deletionTimestamp (no kubelet confirms): keep forcing, never wait forever.
    stuck = Observed(replicas=(lost(1),))
    for dt in (5, 60, 3600):
        d2 = decide(job, d.status, stuck, T0 + timedelta(seconds=dt))
        assert d2.of(DeleteGang) == [DeleteGang(1, "TearingDown", force_nodes=("node-1",))]
        assert d2.status.infra_restarts == 1 and not d2.of(CreateGang)
    d3 = decide(job, d.status, Observed(latest_checkpoint=ck(20)), T0 + timedelta(seconds=10))
    assert d3.of(CreateGang) == [CreateGang(attempt=2, resume_from_step=20, avoid_nodes=("node-1",))]


def test_teardown_the_operator_ordered_is_never_charged() -> None:
    job = make_job(pending_grace=60)
    st = decide(job, JobStatus(), Observed(), T0).status
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Pending")), T0 + timedelta(seconds=61))
    assert d.of(DeleteGang) == [DeleteGang(1, "PendingTimeout")]
    # Our own deletion in progress: the bound pod is terminating (read as Deleted) or already exited on SIGTERM.
    dying = (ReplicaObservation(0, 1, "Failed", reason="Deleted", node="node-0", terminating=True),
             ReplicaObservation(1, 1, "Failed", exit_code=143, node="node-1"))
    d2 = decide(job, d.status, Observed(replicas=dying), T0 + timedelta(seconds=62))
    assert d2.status.infra_restarts == 0 and d2.status.restarts == 0 and d2.status.failed_nodes == {}
    assert d2.of(DeleteGang) and not d2.of(CreateGang) and d2.status.phase == "Scheduling"
    d3 = decide(job, d2.status, Observed(), T0 + timedelta(seconds=63))
    assert d3.of(CreateGang) == [CreateGang(attempt=2, resume_from_step=None)]
    assert d3.status.infra_restarts == 0 and d3.status.restarts == 0


def test_gang_vanishing_while_running_is_an_infrastructure_failure() -> None:
    job = make_job()
    d = decide(job, run_to_running(job), Observed(), T0)
    assert d.status.phase == "Restarting" and d.status.infra_restarts == 1
    d = decide(job, run_to_running(job), Observed(replicas=gang(1, "Running")), T0)  # replica 1 missing
    assert d.status.phase == "Restarting" and d.status.infra_restarts == 1


def test_success_when_every_replica_succeeded() -> None:
    job = make_job()
    st = run_to_running(job)
    d = decide(job, st, Observed(replicas=gang(1, "Succeeded", "Running")), T0)
    assert d.status.phase == "Running"
    d = decide(job, st, Observed(replicas=gang(1, "Succeeded", "Succeeded")), T0 + timedelta(seconds=1))
    assert d.status.phase == "Succeeded" and d.status.completion_time is not None
    assert not d.of(DeleteGang) and not d.of(CreateGang)


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_terminal_phases_stay_terminal_and_only_clean_up(phase: str) -> None:
    job = make_job()
    st = status(phase, attempt=1)
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Failed", exit_code=1)), T0)
    assert d.status.phase == phase and d.of(DeleteGang) == [DeleteGang(1, f"Job{phase}")]
    d = decide(job, st, Observed(), T0)
    assert d.status.phase == phase and d.actions == ()


def test_suspend_deletes_the_gang_and_resume_creates_a_new_incarnation() -> None:
    job = make_job()
    st = run_to_running(job)
    suspended = make_job(suspend=True)
    d = decide(suspended, st, Observed(replicas=gang(1, "Running", "Running")), T0)
    assert d.of(DeleteGang) == [DeleteGang(1, "Suspended")] and d.status.phase == "Suspended"
    d = decide(suspended, d.status, Observed(), T0)
    assert not d.of(CreateGang) and d.status.phase == "Suspended"
    d = decide(job, d.status, Observed(latest_checkpoint=ck(30)), T0)
    assert d.of(CreateGang) == [CreateGang(attempt=2, resume_from_step=30)]
    assert d.status.restarts == 0


def test_stale_incarnation_is_deleted_before_anything_is_created() -> None:
    job = make_job()
    st = status("Pending", attempt=2)
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Running")), T0)
    assert d.of(DeleteGang) == [DeleteGang(1, "StaleIncarnation")] and not d.of(CreateGang)


def test_unschedulable_waits_then_fails_after_the_timeout() -> None:
    job = make_job(sched_timeout=60)
    d = decide(job, JobStatus(), Observed(unschedulable="need 2 nodes with 8 GPUs, have 1"), T0)
    assert not d.of(CreateGang) and d.status.phase == "Scheduling" and d.status.attempt == 0
    assert "need 2 nodes" in d.status.message
    d2 = decide(job, d.status, Observed(unschedulable="still no room"), T0 + timedelta(seconds=30))
    assert d2.status.phase == "Scheduling"
    d3 = decide(job, d2.status, Observed(unschedulable="still no room"), T0 + timedelta(seconds=61))
    assert d3.status.phase == "Failed" and "SchedulingTimeout" in [c.reason for c in d3.status.conditions]


def test_hang_is_a_failure() -> None:
    job = make_job(hang=60)
    st = run_to_running(job)
    fresh = Observed(replicas=gang(1, "Running", "Running"),
                     progress=Progress(step=5, updated_at=iso(T0 + timedelta(seconds=30))))
    assert decide(job, st, fresh, T0 + timedelta(seconds=80)).status.phase == "Running"
    d = decide(job, st, fresh, T0 + timedelta(seconds=100))
    assert d.status.phase == "Restarting" and d.status.restarts == 1
    assert d.of(DeleteGang) == [DeleteGang(1, "Hung")] and "no training step completed for 70s" in d.status.message


def test_decide_does_not_mutate_its_input() -> None:
    job = make_job()
    st = run_to_running(job)
    before = st.model_dump()
    decide(job, st, Observed(replicas=gang(1, "Failed", "Failed", exit_code=1)), T0)
    assert st.model_dump() == before


@pytest.mark.parametrize(("n", "expected"), [(0, 5), (1, 5), (2, 10), (3, 20), (6, 160), (7, 300), (200, 300)])
def test_backoff_table(n: int, expected: float) -> None:
    assert backoff_seconds(make_job(backoff=5, max_backoff=300).spec.fault_tolerance, n) == expected


# ---- properties ---------------------------------------------------------------------------------------------------


@given(base=hs.floats(0, 100), cap=hs.floats(0, 1000), n=hs.integers(1, 500))
def test_backoff_is_exponential_and_capped(base: float, cap: float, n: int) -> None:
    ft = make_job(backoff=base, max_backoff=cap).spec.fault_tolerance
    b = backoff_seconds(ft, n)
    assert 0 <= b <= cap
    assert backoff_seconds(ft, n + 1) >= b
    if base * 2 ** n <= cap:
        assert backoff_seconds(ft, n + 1) == pytest.approx(2 * b)


@dataclass
class FakeWorld:
    """A backend that executes actions: replicas appear Pending on create and disappear (maybe late) on delete."""

    replicas: dict[int, ReplicaObservation] = field(default_factory=dict)
    dying: set[int] = field(default_factory=set)

    def observe(self) -> tuple[ReplicaObservation, ...]:
        return tuple(self.replicas[k] for k in sorted(self.replicas))

    def apply(self, job: SeqTrainJob, actions: tuple, slow_delete: bool) -> None:
        creates = [a for a in actions if isinstance(a, CreateGang)]
        for a in actions:
            if isinstance(a, DeleteGang):
                for k, r in list(self.replicas.items()):
                    if r.attempt == a.attempt:
                        if slow_delete:
                            self.dying.add(k)
                        else:
                            del self.replicas[k]
        for c in creates:
            for i in range(job.spec.replicas):
                key = c.attempt * 1000 + i
                if key not in self.replicas:
                    self.replicas[key] = ReplicaObservation(i, c.attempt, "Pending", node=f"n{i}")

    def reap(self) -> None:
        for k in self.dying:
            self.replicas.pop(k, None)
        self.dying.clear()


_tick = hs.tuples(hs.just("tick"), hs.floats(0, 120))
_start = hs.tuples(hs.just("start"), hs.integers(0, 3))
_fail = hs.tuples(hs.just("fail"), hs.integers(0, 3), hs.sampled_from([1, 1, 4, 137, 137, 143, 3]),
                  hs.sampled_from([None, None, None, "OOMKilled", "Evicted", "NodeLost"]))
# Weighted by repetition (one_of picks branches uniformly): histories must get deep (several restarts) often,
# while suspend / lost capacity / vanishing replicas stay occasional.
_event = hs.one_of(
    _tick, _tick, _tick, _start, _start, _start, _start, _fail, _fail,
    hs.tuples(hs.just("succeed"), hs.just(0)),
    hs.tuples(hs.just("reap"), hs.just(0)),
    hs.tuples(hs.just("vanish"), hs.integers(0, 3)),
    hs.tuples(hs.just("suspend"), hs.sampled_from([False, False, False, True])),
    hs.tuples(hs.just("unschedulable"), hs.sampled_from([False, False, False, True])),
)


@settings(max_examples=300, deadline=None)
@given(events=hs.lists(hs.tuples(_event, hs.sampled_from([False] * 9 + [True])), min_size=10, max_size=80), replicas=hs.integers(1, 3), max_restarts=hs.integers(0, 3),
       max_infra=hs.integers(0, 3), slow_delete=hs.booleans())
def test_random_histories_keep_the_invariants(events: list, replicas: int, max_restarts: int, max_infra: int,
                                              slow_delete: bool) -> None:
    base = make_job(replicas, max_restarts=max_restarts, max_infra=max_infra, backoff=5, max_backoff=60,
                    pending_grace=120)
    suspended = make_job(replicas, max_restarts=max_restarts, max_infra=max_infra, backoff=5, max_backoff=60,
                         pending_grace=120, suspend=True)
    world, st, now = FakeWorld(), JobStatus(), T0
    suspend, unsched = False, False
    first: datetime | None = None
    for ev, lose_write in events:
        # lose_write: the backend executes the actions, then crashes before persisting the status
        kind = ev[0]
        if kind == "tick":
            now += timedelta(seconds=ev[1])
        elif kind == "reap":
            world.reap()
        elif kind == "suspend":
            suspend = ev[1]
        elif kind == "unschedulable":
            unsched = ev[1]
        elif kind == "succeed":
            for k, r in world.replicas.items():
                if r.phase == "Running":
                    world.replicas[k] = ReplicaObservation(r.replica, r.attempt, "Succeeded", 0, node=r.node)
        else:
            live = sorted(world.replicas)
            if not live:
                continue
            k = live[ev[1] % len(live)]
            r = world.replicas[k]
            if kind == "start" and r.phase == "Pending":
                world.replicas[k] = ReplicaObservation(r.replica, r.attempt, "Running", node=r.node)
            elif kind == "fail" and r.phase in ("Pending", "Running"):
                world.replicas[k] = ReplicaObservation(r.replica, r.attempt, "Failed", ev[2], ev[3], node=r.node)
            elif kind == "vanish":
                del world.replicas[k]

        job = suspended if suspend else base
        observed = Observed(replicas=world.observe(), unschedulable="no room" if unsched else None)
        d = decide(job, st, observed, now)
        new = d.status
        creates = d.of(CreateGang)
        # never more than one gang: create only into an empty world, at most once, with a fresh attempt number
        assert len(creates) <= 1
        if creates:
            assert not observed.replicas
            assert creates[0].attempt in (st.attempt, st.attempt + 1)
            assert all(r.attempt < creates[0].attempt for r in world.replicas.values())
            assert not suspend and not unsched or creates[0].attempt == st.attempt
        # monotonic counters, budgets honoured
        assert new.attempt >= st.attempt
        assert new.restarts >= st.restarts and new.infra_restarts >= st.infra_restarts
        assert new.restarts <= max_restarts and new.infra_restarts <= max_infra
        # terminal phases stay terminal
        if st.phase in ("Succeeded", "Failed"):
            assert new.phase == st.phase and not creates
        # every restart waits the exponential backoff
        if new.phase == "Restarting" and st.phase != "Restarting":
            delay = (parse(new.next_restart_time) - now).total_seconds()  # type: ignore[operator]
            assert delay == pytest.approx(backoff_seconds(job.spec.fault_tolerance,
                                                          new.restarts + new.infra_restarts), abs=1e-3)
        assert all(a.seconds >= 0 for a in d.of(RequeueAfter))
        # where the time went adds up: productive + lost = wall time from creation (stopped when the job finished)
        if new.phase not in ("Succeeded", "Failed"):
            if st.time_ledger is None:  # no creation time given: the first pass whose status is kept is the creation
                first = now
            assert wall_seconds(new) == pytest.approx((now - first).total_seconds(), abs=0.01)
        assert new.goodput is None or 0 <= new.goodput <= 1
        world.apply(job, d.actions, slow_delete)
        attempts = {r.attempt for k, r in world.replicas.items() if k not in world.dying}
        assert len(attempts) <= 1
        if not lose_write:
            st = new


# ---- admission, progress, generation, goodput: all decided in the core ---------------------------------------------


def free_node(name: str, gpus: int = 8, **labels: str) -> Node:
    return Node(name=name, gpus=gpus, cpu_millis=64_000, memory_bytes=512 * 2**30, labels=labels)


def gpu_job(replicas: int = 2, gpus: int = 4) -> SeqTrainJob:
    job = make_job(replicas)
    job.spec.resources.gpus = gpus
    return job


def test_native_admission_places_the_gang_in_the_core_and_the_plan_travels_in_the_create_action() -> None:
    job = gpu_job()
    d = decide(job, JobStatus(), Observed(capacity=(free_node("a"), free_node("b", gpus=2))), T0)
    (create,) = d.of(CreateGang)
    assert create.plan is not None and [a.node for a in create.plan.replicas] == ["a", "a"]
    assert [(p.replica, p.node) for p in d.status.placement] == [(0, "a"), (1, "a")]
    # the pods are created but not observed yet: re-create on the same nodes, whatever the capacity says now
    d2 = decide(job, d.status, Observed(capacity=()), T0 + timedelta(seconds=1))
    assert [a.node for a in d2.of(CreateGang)[0].plan.replicas] == ["a", "a"]


def test_insufficient_capacity_says_so_in_a_condition_and_one_event() -> None:
    job = gpu_job(replicas=3)
    short = Observed(capacity=(free_node("a", gpus=8),))
    d = decide(job, JobStatus(), short, T0)
    assert not d.of(CreateGang) and d.status.phase == "Scheduling" and d.status.attempt == 0
    sched = next(c for c in d.status.conditions if c.type == "Scheduled")
    assert (sched.status, sched.reason) == ("False", "Unschedulable") and "need 3 replicas" in sched.message
    assert [e.reason for e in d.of(Event)] == ["Unschedulable"]
    d2 = decide(job, d.status, short, T0 + timedelta(seconds=5))
    assert not d2.of(Event)  # said once, not every pass


def test_unreachable_progress_endpoint_is_progress_unknown_not_a_hang() -> None:
    job = make_job(hang=60)
    st = run_to_running(job)
    blind = Observed(replicas=gang(1, "Running", "Running"), progress_unreachable="GET .../progress timed out")
    d = decide(job, st, blind, T0 + timedelta(seconds=600))
    assert d.status.phase == "Running" and d.status.restarts == 0 and not d.of(DeleteGang)
    progressing = next(c for c in d.status.conditions if c.type == "Progressing")
    assert (progressing.status, progressing.reason) == ("Unknown", "ProgressUnknown")
    assert [e.reason for e in d.of(Event)] == ["ProgressUnknown"]
    # once it answers again with a stale step, hang detection resumes
    stale = Observed(replicas=gang(1, "Running", "Running"), progress=Progress(step=5, updated_at=iso(T0)))
    assert decide(job, d.status, stale, T0 + timedelta(seconds=601)).status.phase == "Restarting"


def test_observed_generation_and_goodput_come_from_the_core() -> None:
    job = make_job()
    st = run_to_running(job)
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Running"), generation=7), T0 + timedelta(seconds=50))
    assert d.status.observed_generation == 7
    assert d.status.goodput is not None
    d2 = decide(job, d.status, Observed(replicas=gang(1, "Running", "Failed", exit_code=1)),
                T0 + timedelta(seconds=100))
    assert d2.status.running_seconds == 100.0
    assert "runningSeconds" in d2.status.to_dict() and d2.status.model_extra == {}


def test_partial_gang_refused_by_the_api_is_torn_down_reported_and_retried_with_backoff() -> None:
    from seqtrain_operator.controller import create_failed

    job = make_job(backoff=5.0)
    st = decide(job, JobStatus(), Observed(), T0).status  # attempt 1 created (status written first)
    quota = 'pods "t-1-1" is forbidden: exceeded quota: q, requested: pods=1, used: pods=1, limited: pods=1'
    d = create_failed(job, st, 1, quota, T0)
    assert d.of(DeleteGang) == [DeleteGang(1, "CreateFailed")] and d.of(RequeueAfter) == [RequeueAfter(5.0)]
    sched = next(c for c in d.status.conditions if c.type == "Scheduled")
    assert (sched.status, sched.reason) == ("False", "CreateFailed") and quota in sched.message
    assert [e.reason for e in d.of(Event)] == ["CreateFailed"] and quota in d.of(Event)[0].message
    assert d.status.restarts == 0 and d.status.infra_restarts == 0 and d.status.create_failures == 1
    # the partial gang is still being deleted: nothing new; then the backoff; then a new attempt
    left = Observed(replicas=(ReplicaObservation(0, 1, "Failed", reason="Deleted", terminating=True),))
    dying = decide(job, d.status, left, T0 + timedelta(seconds=1))
    assert not dying.of(CreateGang) and dying.of(DeleteGang)
    assert dying.status.infra_restarts == 0 and dying.status.phase == "Scheduling"
    waiting = decide(job, d.status, Observed(), T0 + timedelta(seconds=2))
    assert not waiting.of(CreateGang) and waiting.of(RequeueAfter)[0].seconds == pytest.approx(3.0)
    again = decide(job, d.status, Observed(), T0 + timedelta(seconds=6))
    assert again.of(CreateGang) == [CreateGang(attempt=2, resume_from_step=None)]
    # refused again: the delay doubles
    assert create_failed(job, again.status, 2, quota, T0 + timedelta(seconds=6)).of(RequeueAfter) == [
        RequeueAfter(10.0)]


def test_api_message_is_the_apiservers_own() -> None:
    from kubernetes.client.rest import ApiException

    from seqtrain_operator.k8s.api.client import api_message

    exc = ApiException(status=403, reason="Forbidden")
    exc.body = '{"kind":"Status","reason":"Forbidden","message":"pods \\"x\\" is forbidden: exceeded quota: q"}'
    assert api_message(exc) == '403 Forbidden: pods "x" is forbidden: exceeded quota: q'


def test_waiting_for_capacity_looks_again_less_often_the_longer_it_waits() -> None:
    job = gpu_job(replicas=3)
    short = Observed(capacity=(free_node("a", gpus=8),))
    d = decide(job, JobStatus(), short, T0)
    delays = []
    for dt in (1, 40, 100, 1000):
        delays.append(decide(job, d.status, short, T0 + timedelta(seconds=dt)).of(RequeueAfter)[0].seconds)
    assert delays == [5.0, 10.0, 25.0, 60.0]


def test_a_peer_failing_first_after_its_node_died_is_charged_to_the_node_not_the_user() -> None:
    """The dead node's pod still looks Running; its peer fails at once (connection reset). Wait, then NodeLost."""
    job = make_job(max_restarts=0)
    st = run_to_running(job)
    echo = ReplicaObservation(0, 1, "Failed", exit_code=1, node="node-0", finished_at=iso(T0))
    dead = ReplicaObservation(1, 1, "Running", node="node-1")
    d = decide(job, st, Observed(replicas=(echo, dead)), T0 + timedelta(seconds=2))  # node not NotReady yet
    assert not d.of(DeleteGang) and d.status.phase == "Running" and d.of(RequeueAfter)[0].seconds == 13.0
    unready = replace(dead, node_unready=True)
    d = decide(job, st, Observed(replicas=(echo, unready)), T0 + timedelta(seconds=30))  # NotReady, not lost
    assert not d.of(DeleteGang) and d.status.restarts == 0
    lost_ = replace(dead, phase="Failed", reason="NodeLost", node_unready=True, node_lost=True)
    d = decide(job, st, Observed(replicas=(echo, lost_)), T0 + timedelta(seconds=60))
    assert d.status.phase == "Restarting" and d.status.infra_restarts == 1 and d.status.restarts == 0
    assert list(d.status.failed_nodes) == ["node-1"]


def test_a_user_failure_is_charged_after_the_settle_time_or_once_nothing_runs() -> None:
    job = make_job()
    st = run_to_running(job)
    crash = ReplicaObservation(0, 1, "Failed", exit_code=1, node="node-0", finished_at=iso(T0))
    alive = ReplicaObservation(1, 1, "Running", node="node-1")
    assert decide(job, st, Observed(replicas=(crash, alive)), T0 + timedelta(seconds=16)).status.restarts == 1
    both = (crash, replace(alive, phase="Failed", exit_code=4))
    assert decide(job, st, Observed(replicas=both), T0 + timedelta(seconds=1)).status.restarts == 1


def test_a_gang_admitted_after_a_long_wait_for_capacity_gets_its_full_pending_grace() -> None:
    # Found by the 1000-job benchmark: the Scheduled condition stayed False from the wait for capacity to the gang's
    # creation, so its transition time was the wait's start, and the new gang was torn down as pending too long at
    # once (PendingTimeout), re-planned, torn down again, for ever.
    job = make_job(2, pending_grace=300)
    st = decide(job, JobStatus(), Observed(unschedulable="no room"), T0).status
    later = T0 + timedelta(seconds=400)
    d = decide(job, st, Observed(), later)
    assert d.of(CreateGang)
    pending = Observed(replicas=gang(1, "Pending", "Pending"))
    d2 = decide(job, d.status, pending, later + timedelta(seconds=10))
    assert not d2.of(DeleteGang) and d2.status.phase == "Scheduling"
    d3 = decide(job, d2.status, pending, later + timedelta(seconds=301))
    assert d3.of(DeleteGang) == [DeleteGang(1, "PendingTimeout")]  # the grace still applies, from creation


def test_a_native_gang_waiting_in_kube_schedulers_queue_is_not_torn_down_after_the_grace() -> None:
    # Found by the 1000-job benchmark: 8000 pods created in a burst wait minutes for kube-scheduler on a small
    # control plane; tearing their gangs down after pendingGraceSeconds only sent them to the back of the queue.
    job = make_job(2, pending_grace=300)
    st = decide(job, JobStatus(), Observed(), T0).status
    waiting = Observed(replicas=tuple(replace(r, node=None, queued=True) for r in gang(1, "Pending", "Pending")))
    d = decide(job, st, waiting, T0 + timedelta(seconds=900))
    assert not d.of(DeleteGang) and d.status.phase == "Scheduling"
    assert "Queued" not in [e.reason for e in d.of(Event)]  # every native gang is briefly queued: no noise
    # one replica refused by the scheduler (no longer queued) is stuck: the grace applies
    refused = Observed(replicas=(waiting.replicas[0], replace(waiting.replicas[1], queued=False)))
    d = decide(job, st, refused, T0 + timedelta(seconds=900))
    assert d.of(DeleteGang) == [DeleteGang(1, "PendingTimeout")]


def test_a_placed_replica_that_is_starting_is_progress_with_its_own_deadline() -> None:
    # A 10-20 GB CUDA image pull or a volume attach takes longer than pendingGraceSeconds: the gang was torn down and
    # re-planned (pulling again elsewhere) in a loop. Placed and starting now counts toward startTimeoutSeconds.
    job = make_job(pending_grace=60)
    assert job.spec.scheduling.start_timeout_seconds == 1800
    st = decide(job, JobStatus(), Observed(), T0).status
    starting = Observed(replicas=gang(1, "Running", "Starting"))
    d = decide(job, st, starting, T0 + timedelta(seconds=600))
    assert not d.of(DeleteGang) and d.status.phase == "Scheduling" and d.status.restarts == 0
    c = cond.get(d.status, "Starting")
    assert c is not None and (c.status, c.reason) == ("True", "ContainerCreating") and "node-1" in c.message
    d = decide(job, d.status, starting, T0 + timedelta(seconds=1801))
    assert d.of(DeleteGang) == [DeleteGang(1, "StartTimeout")] and d.status.restarts == 0
    assert cond.get(d.status, "Scheduled").reason == "StartTimeout"  # type: ignore[union-attr]


def test_only_unschedulable_replicas_count_toward_the_pending_grace() -> None:
    job = make_job(pending_grace=60)
    st = decide(job, JobStatus(), Observed(), T0).status
    d = decide(job, st, Observed(replicas=gang(1, "Starting", "Pending")), T0 + timedelta(seconds=61))
    assert d.of(DeleteGang) == [DeleteGang(1, "PendingTimeout")]


def test_the_starting_condition_ends_when_the_gang_runs() -> None:
    job = make_job()
    st = decide(job, JobStatus(), Observed(), T0).status
    st = decide(job, st, Observed(replicas=gang(1, "Running", "Starting")), T0 + timedelta(seconds=35)).status
    st = decide(job, st, Observed(replicas=gang(1, "Running", "Running")), T0 + timedelta(seconds=39)).status
    c = cond.get(st, "Starting")
    assert st.phase == "Running" and c is not None and (c.status, c.reason) == ("False", "Started")


def test_a_quick_start_costs_no_starting_condition_and_a_slow_one_says_it_once() -> None:
    # Found by the operator benchmark: the Starting condition's message counted replicas and seconds, so every pass
    # of a starting gang wrote the status (4 extra writes per job, each followed by a GET).
    job = make_job()
    st = decide(job, JobStatus(), Observed(), T0).status
    placed = T0 + timedelta(seconds=60)  # after a minute in kube-scheduler's queue
    starting = tuple(replace(r, placed_at=iso(placed)) for r in gang(1, "Running", "Starting"))
    d = decide(job, st, Observed(replicas=starting), placed + timedelta(seconds=3))
    assert cond.get(d.status, "Starting") is None and d.of(RequeueAfter)[0].seconds == 27.0
    quick = decide(job, d.status, Observed(replicas=gang(1, "Running", "Running")), placed + timedelta(seconds=4))
    assert cond.get(quick.status, "Starting") is None and quick.status.phase == "Running"
    first = decide(job, d.status, Observed(replicas=starting), placed + timedelta(seconds=31)).status
    later = decide(job, first, Observed(replicas=starting), placed + timedelta(seconds=45)).status
    c = cond.get(later, "Starting")
    assert c is not None and (c.status, c.reason) == ("True", "ContainerCreating") and "node-1" in c.message
    assert later.conditions == first.conditions  # the same words: nothing new to write


@pytest.mark.parametrize("reason", ["Preempted", "Evicted", "NodeShutdown"])
def test_a_disruption_restarts_without_spending_a_budget_or_avoiding_the_node(reason: str) -> None:
    # Preemption, a drain (the Eviction API), a graceful node shutdown (spot reclaim): the cluster's choice on a
    # healthy node. They used up maxInfraRestarts and put the node on the avoid list for 600 s.
    job = make_job(max_restarts=0, max_infra=0)
    st = run_to_running(job)
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Failed", reason=reason)), T0)
    assert d.status.phase == "Restarting" and (d.status.restarts, d.status.infra_restarts) == (0, 0)
    assert d.status.failed_nodes == {} and "not counted" in d.status.message
    assert d.of(DeleteGang) == [DeleteGang(1, reason)]
    d2 = decide(job, d.status, Observed(), T0 + timedelta(seconds=10))
    assert d2.of(CreateGang) and d2.of(CreateGang)[0].avoid_nodes == ()


def test_a_replica_overdue_in_terminating_is_force_deleted_saying_so() -> None:
    job = make_job()
    st = run_to_running(job)
    d = decide(job, st, Observed(replicas=gang(1, "Running", "Failed", exit_code=1)), T0)
    assert d.status.phase == "Restarting"
    dying = gang(1, "Failed", "Failed", exit_code=1)
    stuck = Observed(replicas=(replace(dying[0], terminating=True, overdue=True), replace(dying[1], terminating=True)))
    d2 = decide(job, d.status, stuck, T0 + timedelta(seconds=200))
    assert [a.force_nodes for a in d2.of(DeleteGang)] == [("node-0",)]
    c = cond.get(d2.status, "Terminating")
    assert c is not None and (c.status, c.reason) == ("True", "TerminationOverdue") and "node-0" in c.message
    assert [e.reason for e in d2.of(Event)] == ["ForceDeleted"]
    d3 = decide(job, d2.status, stuck, T0 + timedelta(seconds=205))  # said once
    assert not d3.of(Event)
    d4 = decide(job, d3.status, Observed(), T0 + timedelta(seconds=210))
    assert d4.of(CreateGang) and cond.get(d4.status, "Terminating").status == "False"  # type: ignore[union-attr]


def test_a_gang_waits_for_pods_on_an_unreachable_node_and_says_how_to_end_the_wait() -> None:
    job = make_job()
    st = run_to_running(job)
    unreachable = replace(gang(1, "Running", "Failed")[1], reason="NodeUnreachable", node_unready=True)
    d = decide(job, st, Observed(replicas=(gang(1, "Running")[0], unreachable)), T0)
    assert d.status.phase == "Restarting" and d.status.infra_restarts == 1
    assert [a.force_nodes for a in d.of(DeleteGang)] == [()]  # may still run: never forced on that evidence
    dying = Observed(replicas=(replace(unreachable, terminating=True),))
    d2 = decide(job, d.status, dying, T0 + timedelta(seconds=30))
    assert [a.force_nodes for a in d2.of(DeleteGang)] == [()] and not d2.of(CreateGang)
    c = cond.get(d2.status, "NodeUnreachable")
    assert c is not None and c.status == "True" and "node-1" in c.message and "out-of-service" in c.message
    assert [e.reason for e in d2.of(Event)] == ["NodeUnreachable"]
    fenced = Observed(replicas=(replace(unreachable, terminating=True, reason="NodeLost", node_lost=True),))
    d3 = decide(job, d2.status, fenced, T0 + timedelta(seconds=60))
    assert [a.force_nodes for a in d3.of(DeleteGang)] == [("node-1",)]
    d4 = decide(job, d3.status, Observed(), T0 + timedelta(seconds=90))
    assert d4.of(CreateGang) and cond.get(d4.status, "NodeUnreachable").status == "False"  # type: ignore[union-attr]


# ---- in-place restarts (seqtrain.runtime.restart): the launchers restart, the core hands out and charges ----------


def test_a_new_gang_gets_one_backoff_per_in_place_restart_within_the_budget_left() -> None:
    job = make_job(max_restarts=3, backoff=2.0, in_place=2)
    assert decide(job, JobStatus(), Observed(), T0).of(CreateGang)[0].in_place_delays == (2.0, 4.0)
    # two restarts already charged: one left, and it is the third restart (2 * 2**2 = 8 s)
    d = decide(job, JobStatus(restarts=2), Observed(), T0)
    assert d.of(CreateGang)[0].in_place_delays == (8.0,)
    assert decide(job, JobStatus(restarts=3), Observed(), T0).of(CreateGang)[0].in_place_delays == ()


def test_in_place_restarts_0_keeps_todays_behaviour() -> None:
    assert decide(make_job(in_place=0), JobStatus(), Observed(), T0).of(CreateGang)[0].in_place_delays == ()


def in_place_progress(attempt: int, rnd: int, step: int = 12) -> Progress:
    return Progress(step=step, attempt=attempt, restart_round=rnd, updated_at=iso(T0))


def test_a_round_reported_by_rank_0_is_charged_once_with_an_event_naming_the_mode() -> None:
    job = make_job(max_restarts=3, in_place=2)
    st = run_to_running(job)
    st.progress = Progress(step=17)
    seen = Observed(replicas=gang(1, "Running", "Running"), progress=in_place_progress(1, 1),
                    latest_checkpoint=ck(10))
    d = decide(job, st, seen, T0 + timedelta(seconds=30))
    assert (d.status.restarts, d.status.in_place_restarts, d.status.restart_round) == (1, 1, 1)
    assert d.status.attempt == 1 and d.of(CreateGang) == [] and d.of(DeleteGang) == []
    (ev,) = [e for e in d.of(Event) if e.reason == "RestartedInPlace"]
    assert "mode: in-place" in ev.message and "checkpoint step 10" in ev.message and "restart 1/3" in ev.message
    assert d.status.steps_lost == [7]  # step 17 was reached, the ranks resumed from 10
    again = decide(job, d.status, seen, T0 + timedelta(seconds=40))  # level-based: the same round is not recharged
    assert (again.status.restarts, again.status.in_place_restarts) == (1, 1)
    assert not [e for e in again.of(Event) if e.reason == "RestartedInPlace"]


def test_a_round_of_an_earlier_attempt_is_not_charged_to_this_one() -> None:
    job = make_job(max_restarts=3, in_place=2)
    st = run_to_running(job)
    st.attempt = 2
    d = decide(job, st, Observed(replicas=gang(2, "Running", "Running"), progress=in_place_progress(1, 2)), T0)
    assert (d.status.restarts, d.status.in_place_restarts) == (0, 0)


def test_rounds_only_the_launchers_exit_reported_are_charged_before_the_re_creation() -> None:
    # rank 0 never reported its rounds (it failed before its first step each time); the launchers' exit report has
    # them: the 2 in-place restarts spent the budget of 2, so this failure fails the job instead of re-creating it.
    job = make_job(max_restarts=2, in_place=2)
    st = run_to_running(job)
    failed = gang(1, "Failed", "Failed", exit_code=1, restart_round=2)
    d = decide(job, st, Observed(replicas=failed), T0 + timedelta(seconds=60))
    assert d.status.in_place_restarts == 2 and d.status.restarts == 2 and d.status.phase == "Failed"
    assert "maxRestarts (2) reached" in d.status.message


def test_a_re_created_gang_says_so_and_starts_a_new_round_count() -> None:
    job = make_job(max_restarts=3, backoff=1.0, in_place=1)
    st = run_to_running(job)
    failed = gang(1, "Failed", "Failed", exit_code=1, restart_round=1)
    st = decide(job, st, Observed(replicas=failed), T0 + timedelta(seconds=60)).status
    assert (st.phase, st.restarts, st.restart_round) == ("Restarting", 2, 1)
    d = decide(job, st, Observed(), T0 + timedelta(seconds=120))
    (create,) = d.of(CreateGang)
    assert create.attempt == 2 and create.in_place_delays == (4.0,) and d.status.restart_round == 0
    (ev,) = [e for e in d.of(Event) if e.reason == "Restarted"]
    assert "mode: re-created" in ev.message


def test_a_gang_that_does_not_fit_is_created_unpinned_for_the_autoscaler_with_its_own_deadline() -> None:
    job = gpu_job(replicas=3)
    job.spec.scheduling.autoscale_timeout_seconds = 900
    short = Observed(capacity=(free_node("a", gpus=8),), autoscaler=True)
    d = decide(job, JobStatus(), short, T0)
    (create,) = d.of(CreateGang)
    assert create.plan is None and d.status.attempt == 1 and d.status.placement == []
    sched = next(c for c in d.status.conditions if c.type == "Scheduled")
    assert sched.reason == "ScaleUpRequested" and "need 3 replicas" in sched.message and "900s" in sched.message
    assert "ScaleUpRequested" in [e.reason for e in d.of(Event)]
    # not observed yet (a lagging cache): created again, still unpinned
    again = decide(job, d.status, Observed(capacity=(), autoscaler=True), T0 + timedelta(seconds=1))
    assert [c.plan for c in again.of(CreateGang)] == [None]
    # the autoscaler's nodes take minutes: past pendingGraceSeconds (300) it waits, past 900 s it tears down
    waiting = Observed(replicas=gang(1, "Running", "Pending", "Pending"), autoscaler=True)
    assert not decide(job, d.status, waiting, T0 + timedelta(seconds=600)).of(DeleteGang)
    late = decide(job, d.status, waiting, T0 + timedelta(seconds=901))
    assert late.of(DeleteGang) == [DeleteGang(1, "PendingTimeout")]
    assert "autoscaler added no room" in next(c for c in late.status.conditions if c.type == "Scheduled").message


@pytest.mark.parametrize("operator_default, job_says, unpinned", [
    (False, None, False), (True, None, True), (True, False, False), (False, True, True)])
def test_the_jobs_autoscale_overrides_the_operators_default(operator_default: bool, job_says: bool | None,
                                                            unpinned: bool) -> None:
    job = gpu_job(replicas=3)
    job.spec.scheduling.autoscale = job_says
    d = decide(job, JobStatus(), Observed(capacity=(free_node("a", gpus=8),), autoscaler=operator_default), T0)
    assert bool(d.of(CreateGang)) is unpinned
    # a reason that is not capacity (an external scheduler missing, predecessors going) never autoscales
    other = Observed(capacity=(free_node("a", gpus=8),), autoscaler=operator_default, unschedulable="busy")
    assert not decide(job, JobStatus(), other, T0).of(CreateGang)
