"""spec.ttlSecondsAfterFinished: the pure decision (controller core) and the operator shell executing it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

import jobs
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import Condition, JobStatus
from seqtrain_operator.controller import (
    DeleteGang,
    DeleteJob,
    Event,
    Observed,
    ReplicaObservation,
    RequeueAfter,
    decide,
)
from seqtrain_operator.controller.clock import iso

T0 = datetime(2026, 11, 23, 12, 0, 0, tzinfo=timezone.utc)


def make_job(ttl: int | None) -> SeqTrainJob:
    return SeqTrainJob.model_validate(jobs.make_job("t", replicas=2, training={"steps": 10, "globalBatchSize": 16},
                                                    ttlSecondsAfterFinished=ttl))


@pytest.mark.parametrize(("phase", "ttl", "after", "deleted", "requeue"), [
    ("Succeeded", 60, 0, False, 60.0),
    ("Succeeded", 60, 59, False, 1.0),
    ("Succeeded", 60, 60, True, None),
    ("Failed", 0, 0, True, None),
    ("Failed", 3600, 7200, True, None),
    ("Succeeded", None, 10**6, False, None),  # no TTL: kept forever
    ("Running", 1, 10**6, False, None),  # not finished: the TTL does not apply
])
def test_ttl_table(phase, ttl, after, deleted, requeue):
    st = JobStatus(phase=phase, completion_time=iso(T0) if phase in ("Succeeded", "Failed") else None)
    running = tuple(ReplicaObservation(replica=r, attempt=1, phase="Running") for r in range(2))
    obs = Observed(replicas=running) if phase == "Running" else Observed()
    st.attempt = 1
    d = decide(make_job(ttl), st, obs, T0 + timedelta(seconds=after))
    assert bool(d.of(DeleteJob)) is deleted
    if deleted:
        assert [e.reason for e in d.of(Event)] == ["TTLExpired"]
    waits = [r.seconds for r in d.of(RequeueAfter)]
    if requeue is not None:
        assert waits and min(waits) == pytest.approx(requeue)
    elif phase != "Running":
        assert waits == []
    assert d.status.phase == phase  # the TTL never changes the phase


def test_ttl_counts_from_the_last_condition_when_completion_time_is_missing():
    st = JobStatus(phase="Failed", conditions=[
        Condition(type="Failed", status="True", reason="InvalidSpec", message="", last_transition_time=iso(T0))])
    assert decide(make_job(30), st, Observed(), T0 + timedelta(seconds=29)).of(DeleteJob) == []
    assert decide(make_job(30), st, Observed(), T0 + timedelta(seconds=30)).of(DeleteJob) != []


def test_ttl_deletes_even_while_a_leftover_replica_is_stopped():
    st = JobStatus(phase="Failed", attempt=2, completion_time=iso(T0))
    obs = Observed(replicas=(ReplicaObservation(replica=0, attempt=2, phase="Running"),))
    d = decide(make_job(5), st, obs, T0 + timedelta(seconds=5))
    assert d.of(DeleteGang) and d.of(DeleteJob)


def test_the_pass_that_finishes_a_job_asks_for_the_pass_at_its_ttl():
    """A finished job is not polled: without a requeue from the finishing pass, nothing might wake it at its TTL
    (the pods' last events can all arrive before that pass)."""
    st = JobStatus(phase="Running", attempt=1)
    done = tuple(ReplicaObservation(replica=r, attempt=1, phase="Succeeded") for r in range(2))
    d = decide(make_job(30), st, Observed(replicas=done), T0)
    assert d.status.phase == "Succeeded" and not d.of(DeleteJob)
    assert [r.seconds for r in d.of(RequeueAfter)] == [pytest.approx(30.0)]
