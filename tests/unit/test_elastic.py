"""Elastic gangs (spec.minReplicas): which sizes a job may run at, and the controller starting smaller when the full
gang does not fit, then growing back when capacity returns."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from jobs import make_job
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.elastic import sizes
from seqtrain.spec.load import SpecError, parse_job
from seqtrain.spec.status import CheckpointRef, JobStatus
from seqtrain_operator.controller import CreateGang, DeleteGang, Event, Observed, ReplicaObservation, decide
from seqtrain_operator.planner.types import Node

T0 = datetime(2026, 11, 23, 12, 0, 0, tzinfo=timezone.utc)
CPU = 4000  # millicores a replica of the job below asks for (4 processes)


def doc(**spec: object) -> dict:
    base = {"replicas": 4, "minReplicas": 2, "resources": {"processesPerReplica": 4, "cpu": "4", "memory": "1Gi"},
            "training": {"steps": 100, "globalBatchSize": 64, "microBatchSize": 2}}
    return make_job("el", **{**base, **spec})


def job(**spec: object) -> SeqTrainJob:
    return parse_job(doc(**spec))


def nodes(*free_replicas: int) -> tuple[Node, ...]:
    return tuple(Node(f"n{i}", cpu_millis=CPU * k, memory_bytes=2**34) for i, k in enumerate(free_replicas))


def problems(**spec: object) -> str:
    with pytest.raises(SpecError) as err:
        parse_job(doc(**spec))
    return str(err.value)


# ---- the spec ------------------------------------------------------------------------------------------------------


def test_sizes_are_those_the_batch_and_layout_allow_largest_first() -> None:
    assert sizes(job()) == (4, 2)  # 3 replicas = 12 ranks: 64 sequences do not split into 12 x 2
    assert sizes(job(minReplicas=None)) == (4,)
    assert sizes(job(minReplicas=1)) == (4, 2, 1)
    small = job().with_replicas(2)
    assert (small.spec.world_size, small.spec.grad_accum, job().spec.grad_accum) == (8, 4, 2)
    assert small.spec.training.global_batch_size == 64


def test_bad_elastic_settings_name_the_field_and_the_fix() -> None:
    assert "spec.minReplicas: 5 is more than replicas (4)" in problems(minReplicas=5)
    # every engine's checkpoint reshards now (DeepSpeed ZeRO through the DCP format): nothing to refuse
    ds = job(optimization={"engine": "deepspeed", "zero": {"stage": 2}})
    assert ds.spec.elastic and sizes(ds) == (4, 2)
    assert "scheduling.gang: native" in problems(scheduling={"gang": "coscheduling"})
    msg = problems(minReplicas=3)
    # 3 x 4 ranks x microBatchSize 2 do not divide 64 sequences; the message says which sizes do
    assert "spec.minReplicas: 3 replicas cannot run this job (spec.training.globalBatchSize" in msg
    assert "sizes below 4 that work: 2, 1" in msg

def test_a_fixed_gang_may_say_minreplicas_equal_to_replicas() -> None:
    j = job(minReplicas=4)
    assert not j.spec.elastic and sizes(j) == (4,)


# ---- the controller ------------------------------------------------------------------------------------------------


def running(attempt: int, n: int) -> tuple[ReplicaObservation, ...]:
    return tuple(ReplicaObservation(replica=i, attempt=attempt, phase="Running", node=f"n{i}") for i in range(n))


def test_short_capacity_starts_the_largest_size_that_fits_and_says_why() -> None:
    j = job()
    d = decide(j, JobStatus(), Observed(capacity=nodes(1, 1, 1)), T0)  # room for 3, but 3 is not a valid size
    [create] = d.of(CreateGang)
    assert create.replicas == 2 and create.plan is not None and len(create.plan.replicas) == 2
    assert create.plan.world_size == 8
    assert (d.status.replicas, d.status.world_size) == (2, 8)
    [warn] = [e for e in d.of(Event) if e.reason == "ScaledDown"]
    assert warn.type == "Warning" and "2 of 4 replicas" in warn.message and "global batch 64 kept" in warn.message
    assert "4 micro-batches per rank instead of 2" in warn.message


def test_below_minreplicas_waits_like_any_gang() -> None:
    d = decide(job(), JobStatus(), Observed(capacity=nodes(1)), T0)
    assert not d.of(CreateGang) and d.status.phase == "Scheduling"
    assert "Unschedulable" in [e.reason for e in d.of(Event)]


def test_a_fixed_gang_never_starts_smaller() -> None:
    d = decide(job(minReplicas=None), JobStatus(), Observed(capacity=nodes(1, 1, 1)), T0)
    assert not d.of(CreateGang)


def test_a_smaller_gang_runs_and_grows_back_once_capacity_returns() -> None:
    j = job()
    st = decide(j, JobStatus(), Observed(capacity=nodes(2)), T0).status
    st = decide(j, st, Observed(replicas=running(1, 2)), T0 + timedelta(seconds=5)).status
    assert st.phase == "Running" and st.replicas == 2
    # the missing replicas are not a failure: the gang of 2 is whole
    d = decide(j, st, Observed(replicas=running(1, 2), capacity=nodes(2, 2)), T0 + timedelta(seconds=20))
    assert d.status.phase == "Running" and not d.of(DeleteGang)  # too soon after starting to rescale
    later = T0 + timedelta(seconds=60)
    d = decide(j, st, Observed(replicas=running(1, 2), capacity=nodes(2)), later)
    assert d.status.phase == "Running" and not d.of(DeleteGang)  # the full gang does not fit yet
    d = decide(j, st, Observed(replicas=running(1, 2), capacity=nodes(2, 2),
                               latest_checkpoint=CheckpointRef(step=30, path="/c/step-30")), later)
    assert d.of(DeleteGang) == [DeleteGang(1, "ScalingUp")]
    assert d.status.phase == "Restarting" and (d.status.restarts, d.status.infra_restarts) == (0, 0)
    assert "ScalingUp" in [e.reason for e in d.of(Event)]
    d = decide(j, d.status, Observed(capacity=nodes(2, 2), latest_checkpoint=CheckpointRef(step=31, path="/c/s")),
               later + timedelta(seconds=10))
    [create] = d.of(CreateGang)
    assert (create.attempt, create.replicas, create.resume_from_step) == (2, None, 31)
    assert (d.status.replicas, d.status.world_size) == (4, 16)
    assert "ScaledUp" in [e.reason for e in d.of(Event)]
