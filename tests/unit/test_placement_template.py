"""Placement agrees with kube-scheduler on what spec.podTemplate adds: extended resources of the trainer
container, sidecar and init container requests, required node affinity (issue 24, item 5)."""

from __future__ import annotations

import pytest

from jobs import make_job
from seqtrain.spec import SeqTrainJob
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.planner.affinity import matches
from seqtrain_operator.planner.inventory import Requests, pod_requests
from seqtrain_operator.planner.placement import Demand, place, replica_requests
from seqtrain_operator.planner.types import Node, Unschedulable

GI = 2**30
IB = "rdma/ib"


def job(template: dict | None = None, replicas: int = 2, cpu: str = "1") -> SeqTrainJob:
    spec = {"replicas": replicas, "resources": {"gpus": 0, "cpu": cpu, "memory": "1Gi"},
            "training": {"globalBatchSize": replicas}, "scheduling": {"topology": {"policy": "none"}}}
    if template:
        spec["podTemplate"] = template
    return SeqTrainJob.model_validate(make_job("j", "ml", **spec))


TEMPLATE = {"spec": {
    "containers": [{"name": "trainer", "resources": {"limits": {IB: "1"}}},
                   {"name": "shipper", "image": "fluent/fluent-bit:3.1",
                    "resources": {"requests": {"cpu": "3", "memory": "512Mi"}}}],
    "initContainers": [{"name": "warm", "image": "busybox:1.36", "resources": {"requests": {"cpu": "2"}}}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "fabric", "operator": "In", "values": ["ib"]}]}]}}},
}}


def node(name: str, cpu: int, ib: int = 0, **labels: str) -> Node:
    return Node(name=name, cpu_millis=cpu * 1000, memory_bytes=64 * GI, labels=labels,
                other={IB: ib} if ib else {})


def test_a_replica_requests_what_the_pod_the_operator_creates_requests():
    j = job(TEMPLATE)
    pod = m.build_pod(j, Owner(name="j", namespace="ml", uid="u-1"), 1, 0, m.Settings(), "n1")
    from_pod = pod_requests(pod)
    assert replica_requests(j) == Requests(from_pod.gpus, from_pod.cpu_millis, from_pod.memory_bytes, 0,
                                           from_pod.other)
    # trainer 1 CPU + the sidecar's 3 (summed: it runs beside the trainer); the init container's 2 is less
    assert replica_requests(j).cpu_millis == 4000
    assert dict(replica_requests(j).other)[IB] == 1
    assert Demand.of(job()).other == ()  # no template: spec.resources only, as before


def test_the_template_keeps_pods_off_nodes_without_its_resources_or_labels():
    nodes = [node("a", cpu=64),  # lots of CPU, no rdma/ib, no label: placing by spec.resources picked it
             node("b", cpu=6, ib=2, fabric="ib"),  # rdma/ib for 2, but CPU for one replica with its sidecar
             node("c", cpu=6, ib=2, fabric="ib"),
             node("d", cpu=64, ib=8, fabric="eth")]  # the affinity's label does not match
    plan = place(job(TEMPLATE), nodes)
    assert not isinstance(plan, Unschedulable), plan
    assert sorted(r.node for r in plan.replicas) == ["b", "c"]
    # without the template, the fewest nodes: both replicas on a
    assert {r.node for r in place(job(), nodes).replicas} == {"a"}


def test_unschedulable_names_the_template_resource_and_the_affinity():
    got = place(job(TEMPLATE), [node("a", cpu=64), node("b", cpu=6, ib=2, fabric="ib")])
    assert isinstance(got, Unschedulable)
    assert "1 rdma/ib" in got.reason and "4000m CPU" in got.reason, got.reason
    assert "podTemplate node affinity not matched" in got.reason, got.reason


@pytest.mark.parametrize("expr, labels, ok", [
    ({"key": "fabric", "operator": "In", "values": ["ib", "roce"]}, {"fabric": "roce"}, True),
    ({"key": "fabric", "operator": "In", "values": ["ib"]}, {}, False),
    ({"key": "fabric", "operator": "NotIn", "values": ["eth"]}, {}, True),
    ({"key": "fabric", "operator": "NotIn", "values": ["eth"]}, {"fabric": "eth"}, False),
    ({"key": "fabric", "operator": "Exists"}, {"fabric": ""}, True),
    ({"key": "fabric", "operator": "DoesNotExist"}, {"fabric": "ib"}, False),
    ({"key": "gen", "operator": "Gt", "values": ["8"]}, {"gen": "9"}, True),
    ({"key": "gen", "operator": "Lt", "values": ["8"]}, {"gen": "9"}, False),
    ({"key": "gen", "operator": "Gt", "values": ["8"]}, {"gen": "h100"}, False),
])
def test_node_selector_requirements_follow_the_api(expr, labels, ok):
    assert matches([{"matchExpressions": [expr]}], "n", labels) is ok


def test_terms_are_ored_an_empty_term_matches_nothing_and_fields_name_the_node():
    terms = [{"matchExpressions": [{"key": "x", "operator": "Exists"}]},
             {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}]
    assert matches(terms, "n1", {"x": "1"}) and matches(terms, "n2", {}) and not matches(terms, "n3", {})
    assert not matches([{}], "n1", {"x": "1"})
    assert matches([], "n1", {})
