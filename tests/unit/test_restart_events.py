"""What a restart says on Kubernetes (issue 42): the event names the replica, its rank, the exit code and the rank's
error line; and where the gang resumes is never claimed as "none" / "from scratch" for a checkpoint the operator was
not told of: the trainer's own report (resumedFrom) is said once per attempt in the Resumed condition and an event."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from jobs import make_job
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import CheckpointRef, JobStatus, Progress
from seqtrain_operator.controller import CreateGang, Event, Observed, ReplicaObservation, decide, iso
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.pods.observe import observe_replicas

T0 = datetime(2026, 11, 28, 12, 0, 0, tzinfo=timezone.utc)
OWNER = Owner(name="t", namespace="ml", uid="u-1")
ERROR = "RuntimeError: CUDA error: an illegal memory access was encountered"


def job(gpus: int = 0) -> SeqTrainJob:
    return SeqTrainJob.model_validate(make_job(
        "t", "ml", replicas=2, training={"steps": 40, "globalBatchSize": 16},
        resources={"gpus": gpus, "cpu": "1", "memory": "1Gi"},
        faultTolerance={"maxRestarts": 3, "backoffSeconds": 2, "inPlaceRestarts": 0}))


def failed_pod(j: SeqTrainJob, replica: int, code: int, message: str) -> dict[str, Any]:
    """The pod the builder makes for `replica`, after its trainer container ended with `code` and `message`."""
    pod = m.build_pod(j, OWNER, 1, replica, m.Settings(), f"node-{replica}")
    pod["spec"]["nodeName"] = f"node-{replica}"
    pod["status"] = {"phase": "Failed", "containerStatuses": [{"name": m.CONTAINER, "state": {"terminated": {
        "exitCode": code, "reason": "Error", "message": message, "finishedAt": iso(T0 - timedelta(seconds=60))}}}]}
    return pod


def node(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def running(progress: Progress | None = None) -> JobStatus:
    st = decide(job(), JobStatus(), Observed(), T0 - timedelta(seconds=300)).status
    run = tuple(ReplicaObservation(r, 1, "Running", node=f"node-{r}") for r in range(2))
    return decide(job(), st, Observed(replicas=run, progress=progress), T0 - timedelta(seconds=290)).status


def events(d: Any) -> list[Event]:
    return [a for a in d.actions if isinstance(a, Event)]


def test_the_restart_event_names_the_rank_its_exit_code_and_its_error_line() -> None:
    j = job()
    pods = [failed_pod(j, 0, 4, "seqtrain train: error: DistBackendError: a peer rank died\n"),
            failed_pod(j, 1, 1, f"Traceback ...\nseqtrain train: error: {ERROR}\n")]
    replicas = observe_replicas(pods, [node("node-0"), node("node-1")], T0)
    d = decide(j, running(), Observed(replicas=replicas), T0)
    (ev,) = events(d)
    assert ev.reason == "RankFailed" and ev.message.startswith(
        f"replica 1 on node-1 (rank 1) failed (RankFailed, exit code 1): {ERROR}; restart 1/3 in 2s "), ev.message


def test_a_multi_rank_pod_names_the_rank_its_launcher_reported_first() -> None:
    # A rank SIGKILLed writes no error line: the kubelet's fallback to the log tail holds the launcher's lines.
    j = job(gpus=4)  # 4 ranks per pod: replica 1 holds ranks 4-7
    tail = ("step 11/40 loss 4.1\nseqtrain launch: local rank 2 exited with code 137\n"
            "seqtrain launch: local rank 0 exited with code 4\n"
            "seqtrain launch: exit codes of local ranks, in the order they ended: [137, 4, 143, 143]; exiting 137\n")
    pods = [failed_pod(j, 1, 137, tail), failed_pod(j, 0, 4, "seqtrain train: error: DistBackendError: peer died\n")]
    replicas = observe_replicas(pods, [node("node-0"), node("node-1")], T0)
    assert [r.rank for r in replicas] == [None, 6]
    status = decide(j, JobStatus(), Observed(), T0 - timedelta(seconds=300)).status
    status = decide(j, status, Observed(replicas=tuple(ReplicaObservation(r, 1, "Running", node=f"node-{r}")
                                                       for r in range(2))), T0 - timedelta(seconds=290)).status
    (ev,) = events(decide(j, status, Observed(replicas=replicas), T0))
    assert ev.message.startswith("replica 1 on node-1 (rank 6) failed (RankFailed, exit code 137 (killed by SIGKILL))")


def test_a_checkpoint_nobody_reported_is_not_called_none_and_the_trainers_word_is_said_once() -> None:
    """Rank 0 reported step 12 but not the step-10 checkpoint (published after its last step end) when rank 1
    died: the restart cannot know it, so it does not say "none" or "from scratch"; attempt 2's trainer resumes from
    step 10 and says so, and the status then says so too, once."""
    j = job()
    st = running(Progress(step=12, attempt=1, updated_at=iso(T0 - timedelta(seconds=20))))
    dead = tuple(ReplicaObservation(r, 1, "Failed", exit_code=1 if r else 4, node=f"node-{r}",
                                    finished_at=iso(T0 - timedelta(seconds=30))) for r in range(2))
    d = decide(j, st, Observed(replicas=dead), T0)
    (failed,) = events(d)
    assert "step none" not in failed.message and "scratch" not in failed.message, failed.message
    assert failed.message.endswith("from checkpoint step ? (the newest the ranks find; none reported yet)")
    d = decide(j, d.status, Observed(), T0 + timedelta(seconds=5))
    (create,) = d.of(CreateGang)
    assert create.attempt == 2 and create.resume_from_step is None
    (restarted,) = events(d)
    assert "scratch" not in restarted.message and "none reported yet" in restarted.message

    # attempt 2's rank 0 reports where it started: the checkpoint of step 10
    later = T0 + timedelta(seconds=30)
    started = Progress(step=10, attempt=2, resumed_from=10, step_reached_before=12,
                       training_started_at=iso(later), updated_at=iso(later))
    seen = Observed(replicas=tuple(ReplicaObservation(r, 2, "Running", node=f"node-{r}") for r in range(2)),
                    progress=started, latest_checkpoint=CheckpointRef(step=10, path="/c/step-10"))
    d = decide(j, d.status, seen, later)
    resumed = [e for e in events(d) if e.reason == "Resumed"]
    assert [e.message for e in resumed] == ["attempt 2: the trainer resumed from checkpoint step 10"]
    c = cond.get(d.status, "Resumed")
    assert c is not None and (c.status, c.reason) == ("True", "Resumed")
    assert d.status.last_checkpoint.step == 10 and d.status.steps_lost == [2]  # type: ignore[union-attr]
    # level-based: the same report again says nothing new
    again = decide(j, d.status, seen, later + timedelta(seconds=10))
    assert not [e for e in events(again) if e.reason == "Resumed"]


def test_a_restart_that_found_no_checkpoint_says_it_started_over() -> None:
    j = job()
    st = running(Progress(step=3, attempt=1, updated_at=iso(T0 - timedelta(seconds=20))))
    st = st.model_copy(update={"attempt": 2})
    fresh = Progress(step=0, attempt=2, training_started_at=iso(T0), updated_at=iso(T0))
    d = decide(j, st, Observed(replicas=tuple(ReplicaObservation(r, 2, "Running", node=f"node-{r}")
                                              for r in range(2)), progress=fresh), T0)
    (ev,) = [e for e in events(d) if e.reason == "StartedFromScratch"]
    assert ev.type == "Warning" and ev.message == ("attempt 2: the trainer found no complete checkpoint and started "
                                                   "from step 0")
    # a first attempt that starts fresh is the expected case: nothing is said
    first = decide(j, running(), Observed(progress=Progress(step=0, attempt=1, training_started_at=iso(T0)),
                                          replicas=tuple(ReplicaObservation(r, 1, "Running", node=f"node-{r}")
                                                         for r in range(2))), T0)
    assert cond.get(first.status, "Resumed") is None
