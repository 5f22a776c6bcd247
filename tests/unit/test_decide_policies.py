"""decide()'s policies, one table each (as JobSet tests executeFailurePolicy / executeSuccessPolicy): a row is the
status the job had and the gang the backend observed, and the decision expected: the phase, the actions in order
(`Create(attempt, resume)`, `Delete(attempt, reason)`, `Requeue`) and the events' reasons."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from jobs import make_job
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import CheckpointRef, Condition, JobStatus, Progress
from seqtrain_operator.controller import (
    CreateGang,
    Decision,
    DeleteGang,
    Event,
    Observed,
    ReplicaObservation,
    RequeueAfter,
    decide,
    iso,
)
from seqtrain_operator.controller.failed import FAILURE_SETTLE_SECONDS

T0 = datetime(2026, 11, 28, 12, 0, 0, tzinfo=timezone.utc)
BEFORE = iso(T0 - timedelta(seconds=600))


def job(replicas: int = 2, **spec: Any) -> SeqTrainJob:
    ft = {"maxRestarts": 2, "maxInfraRestarts": 2, "backoffSeconds": 5, "inPlaceRestarts": 0,
          **spec.pop("faultTolerance", {})}
    return SeqTrainJob.model_validate(make_job("t", **{
        "replicas": replicas, "training": {"steps": 100, "globalBatchSize": 8 * replicas}, "faultTolerance": ft,
        **spec}))


def rep(replica: int, phase: str, attempt: int = 1, **kw: Any) -> ReplicaObservation:
    kw.setdefault("node", f"node-{replica}" if phase != "Pending" else None)
    return ReplicaObservation(replica=replica, attempt=attempt, phase=phase, **kw)  # type: ignore[arg-type]


def status(phase: str, attempt: int = 1, since: str = BEFORE, **kw: Any) -> JobStatus:
    """A job in `phase` at `attempt`, its conditions as decide() left them when it got there at `since`."""
    conds = [Condition(type="Scheduled", status="True" if phase == "Running" else "False",
                       reason="GangRunning" if phase == "Running" else "GangCreated", last_transition_time=since)]
    if phase == "Running":
        conds.append(Condition(type="Running", status="True", reason="GangRunning", last_transition_time=since))
    return JobStatus(phase=phase, attempt=attempt, replicas=kw.pop("replicas", None), conditions=conds,  # type: ignore[arg-type]
                     attempt_start_time=since, start_time=since, **kw)


@dataclass(frozen=True)
class Row:
    name: str
    status: JobStatus
    observed: Observed
    phase: str
    actions: tuple[str, ...]
    events: tuple[str, ...] = ()
    job: SeqTrainJob = field(default_factory=job)
    check: Any = None  # a last look at the decision: a predicate on it


def summary(d: Decision) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    acts = []
    for a in d.actions:
        if isinstance(a, CreateGang):
            acts.append(f"Create({a.attempt}, {a.resume_from_step})")
        elif isinstance(a, DeleteGang):
            acts.append(f"Delete({a.attempt}, {a.reason})")
        elif isinstance(a, RequeueAfter):
            acts.append("Requeue")
    return d.status.phase, tuple(acts), tuple(a.reason for a in d.actions if isinstance(a, Event))


def run(row: Row) -> Decision:
    d = decide(row.job, row.status, row.observed, T0)
    assert summary(d) == (row.phase, row.actions, row.events), row.name
    if row.check is not None:
        assert row.check(d), f"{row.name}: {d.status.message} {d.actions}"
    return d


def requeue(d: Decision) -> float:
    return next(a.seconds for a in d.actions if isinstance(a, RequeueAfter))


def ck(step: int) -> CheckpointRef:
    return CheckpointRef(step=step, path=f"/ckpt/step-{step}")


def just_now(seconds: float) -> str:
    return iso(T0 - timedelta(seconds=seconds))


# ---- failed: the failure policy executed ----------------------------------------------------------------------------

FAILED = [
    Row("a crashed rank restarts the gang from the checkpoint after the backoff",
        status("Running"), Observed(replicas=(rep(0, "Failed", exit_code=4), rep(1, "Failed", exit_code=1)),
                                    latest_checkpoint=ck(10)),
        "Restarting", ("Delete(1, RankFailed)", "Requeue"), ("RankFailed",),
        check=lambda d: d.status.restarts == 1 and requeue(d) == 5.0),
    Row("a peer still running: the failure settles before it is charged",
        status("Running"), Observed(replicas=(rep(0, "Running"), rep(1, "Failed", exit_code=1,
                                                                      finished_at=just_now(2)))),
        "Running", ("Requeue",), (),
        check=lambda d: d.status.restarts == 0 and requeue(d) == FAILURE_SETTLE_SECONDS - 2),
    Row("exit code 3 is permanent: Failed at once",
        status("Running"), Observed(replicas=(rep(0, "Failed", exit_code=3), rep(1, "Running"))),
        "Failed", ("Delete(1, InvalidConfig)",), ("Failed",)),
    Row("OOMKilled is the user's, and says so",
        status("Running"), Observed(replicas=(rep(0, "Failed", exit_code=137, reason="OOMKilled"),
                                              rep(1, "Failed", exit_code=4))),
        "Restarting", ("Delete(1, OOMKilled)", "Requeue"), ("OOMKilled",),
        check=lambda d: "spec.resources.memory" in d.status.message),
    Row("an eviction is a disruption: no budget spent, no node avoided",
        status("Running"), Observed(replicas=(rep(0, "Failed", reason="Evicted"), rep(1, "Failed", exit_code=4))),
        "Restarting", ("Delete(1, Evicted)", "Requeue"), ("Evicted",),
        check=lambda d: (d.status.restarts, d.status.infra_restarts, d.status.failed_nodes) == (0, 0, {})),
    Row("a lost node is infrastructure: its budget, and the node avoided",
        status("Running"), Observed(replicas=(rep(0, "Failed", reason="NodeLost"), rep(1, "Failed", exit_code=4))),
        "Restarting", ("Delete(1, NodeLost)", "Requeue"), ("NodeLost",),
        check=lambda d: d.status.infra_restarts == 1 and list(d.status.failed_nodes) == ["node-0"]),
    Row("the restart budget spent: Failed",
        status("Running", restarts=2), Observed(replicas=(rep(0, "Failed", exit_code=1), rep(1, "Failed", exit_code=4))),
        "Failed", ("Delete(1, RankFailed)",), ("Failed",),
        check=lambda d: "maxRestarts (2) reached" in d.status.message),
    Row("a replica gone while the gang ran is infrastructure",
        status("Running"), Observed(replicas=(rep(0, "Running"),)),
        "Restarting", ("Delete(1, Deleted)", "Requeue"), ("Deleted",),
        check=lambda d: d.status.infra_restarts == 1),
]


# ---- succeeded: the success policy executed -------------------------------------------------------------------------

SUCCEEDED = [
    Row("every replica exited 0: Succeeded",
        status("Running"), Observed(replicas=(rep(0, "Succeeded", exit_code=0), rep(1, "Succeeded", exit_code=0))),
        "Succeeded", (), ("Succeeded",),
        check=lambda d: d.status.conditions and d.status.completion_time == iso(T0)),
    Row("the trainer stopped early on purpose: its reason",
        status("Running"), Observed(replicas=(rep(0, "Succeeded", exit_code=0), rep(1, "Succeeded", exit_code=0)),
                                    progress=Progress(step=40, stop_reason="EarlyStopped", stop_message="no gain")),
        "Succeeded", (), ("Succeeded",),
        check=lambda d: next(c for c in d.status.conditions if c.type == "Succeeded").reason == "EarlyStopped"),
    Row("one replica still running: not yet",
        status("Running"), Observed(replicas=(rep(0, "Succeeded", exit_code=0), rep(1, "Running"))),
        "Running", (), ()),
]


# ---- running ----------------------------------------------------------------------------------------------------

def _stamped(seconds_ago: float) -> Progress:
    return Progress(step=5, updated_at=just_now(seconds_ago))


RUNNING = [
    Row("every replica running: Running, said once",
        status("Scheduling"), Observed(replicas=(rep(0, "Running"), rep(1, "Running"))),
        "Running", (), ("Running",)),
    Row("no step within hangTimeoutSeconds: a hang, restarted",
        status("Running", progress=_stamped(120)), Observed(replicas=(rep(0, "Running"), rep(1, "Running"))),
        "Restarting", ("Delete(1, Hung)", "Requeue"), ("Hung",), job=job(faultTolerance={"hangTimeoutSeconds": 60})),
    Row("progress unreadable: hang detection pauses, saying why",
        status("Running", progress=_stamped(120)),
        Observed(replicas=(rep(0, "Running"), rep(1, "Running")), progress_unreachable="GET /progress timed out"),
        "Running", ("Requeue",), ("ProgressUnknown",), job=job(faultTolerance={"hangTimeoutSeconds": 60})),
    Row("stepping: look again at the hang limit",
        status("Running", progress=_stamped(5)), Observed(replicas=(rep(0, "Running"), rep(1, "Running"))),
        "Running", ("Requeue",), (), job=job(faultTolerance={"hangTimeoutSeconds": 60}),
        check=lambda d: requeue(d) == 60.0),
]


# ---- pending ----------------------------------------------------------------------------------------------------

PENDING = [
    Row("refused by the scheduler past pendingGraceSeconds: torn down and re-planned",
        status("Scheduling"), Observed(replicas=(rep(0, "Running"), rep(1, "Pending"))),
        "Scheduling", ("Delete(1, PendingTimeout)",), ("PendingTimeout",),
        job=job(scheduling={"pendingGraceSeconds": 300})),
    Row("refused within the grace: wait until it ends",
        status("Scheduling", since=just_now(100)), Observed(replicas=(rep(0, "Running"), rep(1, "Pending"))),
        "Scheduling", ("Requeue",), (), job=job(scheduling={"pendingGraceSeconds": 300}),
        check=lambda d: requeue(d) == 30.0),
    Row("an image pull retried within its limit: waiting, saying so",
        status("Scheduling", since=just_now(10)),
        Observed(replicas=(rep(0, "Pending", node="n0", reason="ImagePullBackOff", message="back-off"),
                           rep(1, "Running"))),
        "Scheduling", ("Requeue",), (), check=lambda d: "retrying the image pull" in d.status.message),
    Row("an image pull failing past imagePullTimeoutSeconds: Failed",
        status("Scheduling"), Observed(replicas=(rep(0, "Pending", node="n0", reason="ErrImagePull"),
                                                 rep(1, "Running"))),
        "Failed", ("Delete(1, ErrImagePull)",), ("Failed",), job=job(faultTolerance={"imagePullTimeoutSeconds": 60})),
    Row("placed and starting for long: the Starting condition, once",
        status("Scheduling", since=just_now(40)), Observed(replicas=(rep(0, "Pending", node="n0"), rep(1, "Running"))),
        "Scheduling", ("Requeue",), (),
        check=lambda d: next(c for c in d.status.conditions if c.type == "Starting").status == "True"),
    Row("queued whole in Kueue: kept, said once",
        status("Scheduling"), Observed(replicas=(rep(0, "Pending", queued=True), rep(1, "Pending", queued=True))),
        "Scheduling", ("Requeue",), ("Queued",), job=job(scheduling={"gang": "kueue", "queue": "q"})),
]


# ---- no gang: admit, wait, re-create ----------------------------------------------------------------------------

ABSENT = [
    Row("a new job: attempt 1 created from scratch",
        JobStatus(), Observed(), "Scheduling", ("Create(1, None)",), ("GangCreated",)),
    Row("restarting, the backoff not over: wait for it",
        status("Restarting", next_restart_time=iso(T0 + timedelta(seconds=4))), Observed(),
        "Restarting", ("Requeue",), (), check=lambda d: requeue(d) == 4.0),
    Row("restarting, the backoff over: attempt 2 from the checkpoint",
        status("Restarting", next_restart_time=just_now(1), last_checkpoint=ck(10)), Observed(),
        "Scheduling", ("Create(2, 10)",), ("Restarted",)),
    Row("the gang vanished while running: infrastructure",
        status("Running"), Observed(), "Restarting", ("Delete(1, Deleted)", "Requeue"), ("Deleted",)),
    Row("an earlier attempt's replica still dying: wait for it",
        status("Restarting", attempt=2, next_restart_time=just_now(1)),
        Observed(replicas=(rep(0, "Failed", attempt=1, terminating=True),)),
        "Restarting", ("Delete(1, StaleIncarnation)", "Requeue"), ()),
]


@pytest.mark.parametrize("row", FAILED, ids=lambda r: r.name)
def test_failed(row: Row) -> None:
    run(row)


@pytest.mark.parametrize("row", SUCCEEDED, ids=lambda r: r.name)
def test_succeeded(row: Row) -> None:
    run(row)


@pytest.mark.parametrize("row", RUNNING, ids=lambda r: r.name)
def test_running(row: Row) -> None:
    run(row)


@pytest.mark.parametrize("row", PENDING, ids=lambda r: r.name)
def test_pending(row: Row) -> None:
    run(row)


@pytest.mark.parametrize("row", ABSENT, ids=lambda r: r.name)
def test_no_gang(row: Row) -> None:
    run(row)
