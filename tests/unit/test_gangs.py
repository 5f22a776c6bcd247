"""External gang scheduler adapters (k8s/gangs/): the objects each one needs, what counts as queued or released,
and the controller core keeping a queued gang instead of tearing it down."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from jobs import make_job
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import JobStatus
from seqtrain_operator.controller import DeleteGang, Observed, ReplicaObservation, decide
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.k8s.cache.memory import JobMemory
from seqtrain_operator.k8s.gangs import ADAPTERS, adapter_for
from seqtrain_operator.k8s.gangs import kueue as kq
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.passes.reconcile import _replicas
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.settings import Settings

OWNER = Owner(name="gpt", namespace="ml", uid="0a1b2c3d-4e5f")
T0 = datetime(2026, 11, 23, 12, 0, 0, tzinfo=timezone.utc)


def job(gang: str = "kueue", queue: str | None = "team-a", replicas: int = 2, grace: int = 60) -> SeqTrainJob:
    return SeqTrainJob.model_validate(make_job(
        "gpt", "ml", replicas=replicas, training={"steps": 10, "globalBatchSize": 8 * replicas},
        scheduling={"gang": gang, "queue": queue, "pendingGraceSeconds": grace}))


def pod(attempt: int = 1, replica: int = 0, *, phase: str = "Pending", node: str | None = None, gates=(),
        finalizers=(), deleting: bool = False) -> dict:
    meta = {"name": f"gpt-{attempt}-{replica}", "namespace": "ml", "finalizers": list(finalizers),
            "labels": {m.LABEL_JOB: "gpt", m.LABEL_ATTEMPT: str(attempt), m.LABEL_REPLICA: str(replica),
                       kq.GROUP_LABEL: "gpt-0a1b2c3d"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-23T12:00:00Z"
    spec = {"schedulingGates": [{"name": g} for g in gates]}
    if node:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def test_every_gang_of_the_spec_has_an_adapter_and_every_adapter_its_crd():
    gangs = SeqTrainJob.model_json_schema()["$defs"]["SchedulingSpec"]["properties"]["gang"]["enum"]
    assert set(ADAPTERS) == set(gangs) - {"native"}
    assert adapter_for("native") is None
    assert {a.crd for a in ADAPTERS.values()} == {"podgroups.scheduling.x-k8s.io", "podgroups.scheduling.volcano.sh",
                                                  "workloads.kueue.x-k8s.io", "podgroups.scheduling.run.ai"}


def test_kueue_group_is_stable_across_attempts_and_unique_per_job():
    a = adapter_for("kueue")
    assert a.group_name(job(), OWNER, 1) == a.group_name(job(), OWNER, 7) == "gpt-0a1b2c3d"
    other = Owner(name="gpt", namespace="ml", uid="ffff0000-1111")
    assert a.group_name(job(), other, 1) != a.group_name(job(), OWNER, 1)


@pytest.mark.parametrize(("gang", "queue", "problem"), [
    ("kueue", None, "needs scheduling.queue"),
    ("coscheduling", "q", "has no queues"),
    ("coscheduling", None, None),
    ("volcano", None, None),
    ("kai", None, None),
])
def test_config_problems(gang, queue, problem):
    found = adapter_for(gang).config_problem(job(gang, queue))
    assert (found is None) if problem is None else (problem in found)


def test_kai_defaults_to_its_default_queue():
    g = m.build_gang(job("kai", None), OWNER, 1, m.Settings(), None)
    assert g.podgroup["spec"]["queue"] == "default-queue"
    assert g.pods[0]["metadata"]["labels"]["kai.scheduler/queue"] == "default-queue"
    assert "ownerReferences" not in g.pods[0]["metadata"] and g.podgroup["metadata"]["ownerReferences"]


def test_kueue_queued_only_while_gated_and_released_only_when_ended_and_held_by_its_finalizer():
    a = adapter_for("kueue")
    assert a.queued(pod(gates=[kq.GATE]))
    assert not a.queued(pod())  # ungated: admitted, now the scheduler's
    assert a.released(pod(phase="Failed", finalizers=[kq.FINALIZER], deleting=True))
    assert not a.released(pod(phase="Running", finalizers=[kq.FINALIZER], deleting=True))  # still stopping
    assert not a.released(pod(phase="Failed", finalizers=[kq.FINALIZER]))  # not deleted by anyone
    assert not a.released(pod(phase="Failed", finalizers=["other/finalizer"], deleting=True))
    assert a.released(pod(gates=[kq.GATE], finalizers=[kq.FINALIZER], deleting=True))  # deleted while queued


def test_podgroup_schedulers_count_unbound_pods_as_queued():
    a = adapter_for("coscheduling")
    assert a.queued(pod()) and not a.queued(pod(node="n1"))


def test_observe_leaves_out_released_pods_and_marks_queued_ones():
    pods = [pod(1, 0, phase="Failed", finalizers=[kq.FINALIZER], deleting=True),
            pod(1, 1, phase="Failed", finalizers=[kq.FINALIZER], deleting=True),
            pod(2, 0, gates=[kq.GATE]), pod(2, 1, gates=[kq.GATE])]
    seen = _replicas(adapter_for("kueue"), pods, [], T0, Settings())
    assert [(r.attempt, r.replica, r.queued) for r in seen] == [(2, 0, True), (2, 1, True)]


def _queued_gang(attempt: int, queued: bool = True, phases=("Pending", "Pending")):
    return tuple(ReplicaObservation(replica=i, attempt=attempt, phase=ph, queued=queued and ph == "Pending")
                 for i, ph in enumerate(phases))


def _scheduling(since: datetime) -> JobStatus:
    st = JobStatus(phase="Scheduling", attempt=1)
    cond.set_condition(st, "Scheduled", "False", "GangCreated", "attempt 1 created", since)
    return st


def test_a_gang_waiting_in_the_queue_is_kept_past_pending_grace():
    st = _scheduling(T0)
    d = decide(job(grace=60), st, Observed(replicas=_queued_gang(1)), T0 + timedelta(seconds=3600))
    assert d.of(DeleteGang) == []
    c = cond.get(d.status, "Scheduled")
    assert c.reason == "Queued" and "queue team-a" in c.message
    # admitted an hour later: pendingGraceSeconds counts from the admission, not from the creation
    later = T0 + timedelta(seconds=3600 + 5)
    d2 = decide(job(grace=60), d.status, Observed(replicas=_queued_gang(1, queued=False)), later)
    assert d2.of(DeleteGang) == [] and cond.get(d2.status, "Scheduled").reason == "Admitted"
    d3 = decide(job(grace=60), d2.status, Observed(replicas=_queued_gang(1, queued=False)),
                later + timedelta(seconds=61))
    assert [a.reason for a in d3.of(DeleteGang)] == ["PendingTimeout"]


def test_a_partly_started_gang_is_not_queued():
    st = _scheduling(T0)
    obs = Observed(replicas=_queued_gang(1, phases=("Running", "Pending")))
    d = decide(job(grace=60), st, obs, T0 + timedelta(seconds=61))
    assert [a.reason for a in d.of(DeleteGang)] == ["PendingTimeout"]


@pytest.mark.parametrize(("scheduling", "words"), [
    ({"gang": "kueue"}, "Kueue LocalQueue"),
    ({"gang": "coscheduling", "queue": "q"}, "has no queues"),
])
def test_validate_refuses_a_queue_the_scheduler_cannot_use(scheduling, words):
    from seqtrain.spec import SpecError, parse_job

    doc = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "g"},
           "spec": {"replicas": 2, "training": {"globalBatchSize": 16}, "scheduling": scheduling}}
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    assert any(p.path == "spec.scheduling.queue" and words in p.message for p in err.value.problems)


def test_a_queued_coscheduling_gang_has_its_podgroup_touched_at_most_every_retry_interval(monkeypatch):
    """Coscheduling retries a refused gang only on a PodGroup update (or a pod add): the operator touches the queued
    gang's PodGroup, throttled per group."""
    import asyncio

    from seqtrain_operator.k8s.api import calls
    from seqtrain_operator.k8s.gangs import coscheduling as cs

    patches: list[tuple[str, str, dict]] = []

    async def patch_custom(kube, api, plural, namespace, name, patch):  # noqa: ANN001, ANN202
        patches.append((api, f"{namespace}/{name}", patch))

    clock = [1000.0]
    monkeypatch.setattr(calls, "patch_custom", patch_custom)
    monkeypatch.setattr(cs.time, "monotonic", lambda: clock[0])
    adapter, j = adapter_for("coscheduling"), job("coscheduling", queue=None)
    mem = JobMemory(OWNER.namespace, OWNER.name, OWNER.uid)  # the throttle is the job's own
    for dt in (0.0, 1.0, cs.RETRY_SECONDS):  # at once, not again a second later, again after the interval
        clock[0] += dt
        asyncio.run(adapter.on_queued(None, j, OWNER, 1, mem))
    assert [(a, where) for a, where, _ in patches] == [("scheduling.x-k8s.io/v1alpha1", "ml/gpt-1")] * 2
    assert cs.RETRY_ANNOTATION in patches[0][2]["metadata"]["annotations"]
    asyncio.run(adapter.on_queued(None, j, OWNER, 2, mem))  # the next attempt's PodGroup: at once
    assert [where for _, where, _ in patches] == ["ml/gpt-1", "ml/gpt-1", "ml/gpt-2"]
    asyncio.run(adapter_for("volcano").on_queued(None, job("volcano"), OWNER, 1, mem))  # others need no touch
    assert len(patches) == 3


@pytest.mark.parametrize(("seconds", "per_point", "cap", "boost"), [
    (0.0, 60, 50, 0), (59.9, 60, 50, 0), (60.0, 60, 50, 1), (3599.0, 60, 50, 50),  # capped below the next class
    (600.0, 0, 50, 0), (600.0, 60, 0, 0), (None, 60, 50, 0)])  # off, or nothing reported
def test_the_priority_boost_counts_whole_points_of_work_at_risk_up_to_the_cap(seconds, per_point, cap, boost):
    from seqtrain.spec.status import WorkAtRisk
    from seqtrain_operator.controller.checkpoint_policy import priority_boost

    risk = None if seconds is None else WorkAtRisk(checkpoint_step=10, steps=5, seconds=seconds)
    assert priority_boost(risk, per_point, cap) == boost


def test_a_running_kueue_gang_has_its_workloads_boost_written_when_it_changes(monkeypatch):
    """Kueue orders preemption candidates by priority + the Workload's kueue.x-k8s.io/priority-boost: the operator
    writes the job's (work at risk) there, once per change; a Workload not created yet is tried again."""
    import asyncio

    from seqtrain_operator.k8s.api import calls

    patches: list[tuple[str, str, dict]] = []
    exists = [False]

    async def patch_custom(kube, api, plural, namespace, name, patch):  # noqa: ANN001, ANN202
        patches.append((f"{api}/{plural}", f"{namespace}/{name}", patch))
        return exists[0]

    monkeypatch.setattr(calls, "patch_custom", patch_custom)
    adapter, j = adapter_for("kueue"), job()
    group = kq.group_name_for(OWNER.name, OWNER.uid)
    kube, mem = _NoKube(), JobMemory(OWNER.namespace, OWNER.name, OWNER.uid)
    asyncio.run(adapter.on_running(kube, j, OWNER, 3, mem))  # no Workload yet: tried again
    exists[0] = True
    for boost in (3, 3, 0, 0, 7):
        asyncio.run(adapter.on_running(kube, j, OWNER, boost, mem))
    assert [(where, p["metadata"]["annotations"][kq.BOOST_ANNOTATION]) for _, where, p in patches] == \
        [(f"ml/{group}", v) for v in ("3", "3", "0", "7")]
    assert {api for api, _, _ in patches} == {"kueue.x-k8s.io/v1beta2/workloads"}
    asyncio.run(adapter.on_finished(kube, j, OWNER, [], mem))  # forgotten with the job: a new one writes again
    assert mem.boost is None


class _NoKube:
    """on_finished deletes the Workload through calls.delete_custom: a kube whose call does nothing, and whose
    Workload CRD serves `served`."""

    custom = type("Custom", (), {"delete_namespaced_custom_object": staticmethod(lambda *a, **k: None)})()

    def __init__(self, served: tuple[str, ...] = ("v1beta1", "v1beta2")):
        self.served = list(served)

    async def _call(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202
        return fn(*args, **kwargs)

    async def served_versions(self, crd: str) -> list[str]:
        assert crd == kq.WORKLOAD_CRD
        return self.served


@pytest.mark.parametrize(("served", "api"), [
    (["v1beta1", "v1beta2"], "kueue.x-k8s.io/v1beta2"),  # Kueue v0.15-v0.19
    (["v1beta2"], "kueue.x-k8s.io/v1beta2"),  # Kueue v0.20: v1beta1 no longer served
    (["v1beta1"], "kueue.x-k8s.io/v1beta1"),  # releases before v1beta2
    ([], None), (["v1alpha1"], None)])
def test_the_kueue_adapter_speaks_the_workload_version_the_crd_serves(served, api):
    assert kq.workload_api(served) == api


def test_workload_deletes_and_boosts_go_to_the_served_version_and_are_skipped_when_none_is(monkeypatch):
    import asyncio

    from seqtrain_operator.k8s.api import calls

    seen: list[str] = []

    async def delete_custom(kube, api, plural, namespace, name):  # noqa: ANN001, ANN202
        seen.append(f"delete {api}")

    async def patch_custom(kube, api, plural, namespace, name, patch):  # noqa: ANN001, ANN202
        seen.append(f"patch {api}")
        return True

    monkeypatch.setattr(calls, "delete_custom", delete_custom)
    monkeypatch.setattr(calls, "patch_custom", patch_custom)
    adapter, j = adapter_for("kueue"), job()
    for served in (["v1beta2"], ["v1beta1"], []):
        kube, mem = _NoKube(tuple(served)), JobMemory(OWNER.namespace, OWNER.name, OWNER.uid)
        asyncio.run(adapter.on_running(kube, j, OWNER, 1, mem))
        asyncio.run(adapter.on_finished(kube, j, OWNER, [], mem))
    assert seen == ["patch kueue.x-k8s.io/v1beta2", "delete kueue.x-k8s.io/v1beta2",
                    "patch kueue.x-k8s.io/v1beta1", "delete kueue.x-k8s.io/v1beta1"]


@pytest.mark.parametrize(("topology", "annotations"), [
    (None, {}),  # not set in the spec: no TAS request (a queue without a Topology would never admit one)
    ({"policy": "require", "keys": ["topology.kubernetes.io/zone", "example.com/rack"]},
     {kq.REQUIRED_TOPOLOGY: "example.com/rack"}),
    ({"policy": "pack", "keys": ["example.com/rack"]}, {kq.PREFERRED_TOPOLOGY: "example.com/rack"}),
    ({"policy": "spread"}, {}), ({"policy": "none"}, {})])
def test_a_kueue_gang_carries_the_tas_request_its_topology_asks_for(topology, annotations):
    j = job().model_dump(by_alias=True, exclude_unset=True)
    if topology is not None:
        j["spec"]["scheduling"]["topology"] = topology
    _, ann = adapter_for("kueue").pod_metadata(SeqTrainJob.model_validate(j), OWNER, 1)
    assert {k: v for k, v in ann.items() if "topology" in k} == annotations


def test_a_kueue_gang_names_its_rank_label_so_tas_places_consecutive_ranks_together():
    """Kueue's TAS fills the domains it chose in rank order only when it can read each pod's rank; without the
    annotation it assigns pods to domains greedily and tensor-parallel peers may land in different racks."""
    from seqtrain_operator.k8s.owner import LABEL_REPLICA

    _, ann = adapter_for("kueue").pod_metadata(job(), OWNER, 1)
    assert ann[kq.INDEX_LABEL_ANNOTATION] == LABEL_REPLICA


@pytest.mark.parametrize(("topology", "constraint"), [
    (None, None),
    ({"policy": "require", "keys": ["example.com/block", "example.com/rack"], "name": "cluster-topology"},
     {"topology": "cluster-topology", "requiredTopologyLevel": "example.com/rack"}),
    ({"policy": "pack", "keys": ["example.com/rack"], "name": "cluster-topology"},
     {"topology": "cluster-topology", "preferredTopologyLevel": "example.com/rack"}),
    ({"policy": "spread", "keys": ["example.com/rack"], "name": "cluster-topology"}, None),
])
def test_a_kai_podgroup_carries_the_topology_constraint_its_spec_asks_for(topology, constraint):
    from seqtrain.spec import parse_job

    doc = job("kai", "research").model_dump(by_alias=True, exclude_none=True, exclude_unset=True)
    if topology is not None:
        doc["spec"].setdefault("scheduling", {})["topology"] = topology
    j = parse_job(doc)
    pg = m.build_gang(j, OWNER, 1, m.Settings(), None).podgroup
    assert pg["spec"].get("topologyConstraint") == constraint


def test_a_kai_topology_without_its_name_is_refused_naming_the_field():
    from seqtrain.spec import SpecError, parse_job

    doc = job("kai", "research").model_dump(by_alias=True, exclude_none=True, exclude_unset=True)
    doc["spec"].setdefault("scheduling", {})["topology"] = {"policy": "require", "keys": ["example.com/rack"]}
    with pytest.raises(SpecError, match=r"spec.scheduling.topology.name: gang kai places a gang by a named Topology"):
        parse_job(doc)
