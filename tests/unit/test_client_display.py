"""What `seqtrain list` and `seqtrain status` print, from typed statuses built with small builders."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from seqtrain.spec.status import CheckpointRef, Condition, JobStatus, LostSeconds, Progress, ReplicaPlacement
from seqtrain_operator.client.display import duration, list_table, status_text
from seqtrain_operator.client.model import Event, Job, job_from_object

NOW = datetime(2026, 1, 2, 12, 0, 0, tzinfo=timezone.utc)


def job(name: str = "demo", phase: str = "Running", step: int = 40, total: int = 60, **status: object) -> Job:
    progress = Progress.model_validate({"step": step, "totalSteps": total, "loss": 2.34567, "tokensPerSecond": 5123.4,
                                        "etaSeconds": 75})
    st = JobStatus(phase=phase, progress=progress, **status)  # type: ignore[arg-type]
    return Job(name=name, namespace="ns", status=st, spec={"training": {"steps": total}},
               created="2026-01-02T11:57:30Z")


@pytest.mark.parametrize(("seconds", "want"), [
    (None, "-"), (-1, "-"), (float("nan"), "-"), (0, "0s"), (59.9, "59s"), (75, "1m15s"), (600, "10m"),
    (3600 + 5 * 60, "1h5m"), (7200, "2h"), (86400 * 3 + 3600 * 4, "3d4h"),
])
def test_duration_is_kubectls_short_form(seconds: float | None, want: str) -> None:
    assert duration(seconds) == want


def test_list_shows_step_of_total_loss_rate_restarts_eta_and_age() -> None:
    out = list_table([job(restarts=1, infra_restarts=1), job("done", "Succeeded", 60, 60)], NOW)
    head, first, second = out.splitlines()
    assert head.split() == ["NAME", "PHASE", "STEP", "LOSS", "TOK/S", "RESTARTS", "ETA", "AGE"]
    assert first.split() == ["demo", "Running", "40/60", "2.3457", "5,123", "2", "1m15s", "2m30s"]
    assert second.split()[:3] == ["done", "Succeeded", "60/60"] and second.split()[6] == "-"  # no ETA when done


def test_list_of_every_namespace_starts_with_the_namespace() -> None:
    head, row = list_table([job()], NOW, namespaces=True).splitlines()
    assert head.split()[:2] == ["NAMESPACE", "NAME"] and row.split()[:3] == ["ns", "demo", "Running"]


def test_list_without_progress_shows_dashes_and_the_spec_total() -> None:
    j = Job(name="new", namespace="ns", status=JobStatus(), spec={"training": {"steps": 100}}, created=None)
    assert list_table([j], NOW).splitlines()[1].split() == ["new", "Pending", "0/100", "-", "-", "0", "-", "-"]


def test_status_says_progress_restarts_with_reasons_lost_time_checkpoint_and_events() -> None:
    j = job(restarts=1, in_place_restarts=0, attempt=2, world_size=2, replicas=2, steps_lost=[4],
            placement=[ReplicaPlacement(replica=0, node="cpu-0", ranks=[0]),
                       ReplicaPlacement(replica=1, node="cpu-1", ranks=[1])],
            last_checkpoint=CheckpointRef(step=40, path="/checkpoints/demo/step-40", time="2026-01-02T11:59:00Z"),
            lost_seconds=LostSeconds(restart=12.5, startup=3.0, queueing=0.1), goodput=0.8,
            conditions=[Condition(type="Running", status="True", reason="GangRunning", message="all up",
                                  last_transition_time="2026-01-02T11:59:30Z")])
    events = [Event("2026-01-02T11:58:00Z", "Normal", "GangCreated", "attempt 1: gang of 2 replica(s) created"),
              Event("2026-01-02T11:58:40Z", "Warning", "ReplicaFailed",
                    "replica 1 exited 1; restart 1/3 in 2s from checkpoint step 36"),
              Event("2026-01-02T11:58:45Z", "Normal", "Restarted", "attempt 2: gang of 2 replica(s) re-created")]
    out = status_text(j, events, NOW)
    assert "step 40/60 (66.7%), loss 2.3457, 5,123 tok/s, ETA 1m15s" in out
    assert "Restarts:   1 (0 in place); steps redone per restart: 4" in out
    assert "ReplicaFailed: replica 1 exited 1; restart 1/3" in out  # the reason, under Restarts
    assert "Checkpoint: step 40 at /checkpoints/demo/step-40, saved 1m ago" in out
    assert "Lost time:  startup 3s, restart 12s; goodput 80%" in out  # 0.1 s of queueing is not worth a word
    assert "\n            replica 1 on cpu-1 (ranks 1)\n" in out  # under Gang, no label of its own
    assert "GangRunning" in out and "Events (last 3):" in out and "GangCreated" in out


def test_a_status_this_version_cannot_read_is_shown_not_raised() -> None:
    j = job_from_object({"metadata": {"name": "x", "namespace": "ns"}, "spec": {},
                         "status": {"phase": "Exploding", "restarts": "many"}})
    assert j.phase == "Pending" and "upgrade the client" in j.status.message
    assert "upgrade the client" in status_text(j, (), NOW)


def test_ranks_of_a_replica_come_from_placement_else_the_process_count() -> None:
    j = Job(name="x", namespace="ns", status=JobStatus(world_size=4, replicas=2), spec={})
    assert j.ranks_of(1) == (2, 3)
    j = Job(name="x", namespace="ns", status=JobStatus(placement=[ReplicaPlacement(replica=0, node="n", ranks=[5])]),
            spec={})
    assert j.ranks_of(0) == (5,)
