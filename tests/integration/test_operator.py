"""The real kopf operator against the real control plane (scripts/testbed.sh): the gang's whole life.

The apiserver validates and defaults what the operator writes, RBAC is the chart's, kube-scheduler binds the pods
to the nodes the plan pinned them to, kwok runs them, the garbage collector removes what the job owned. The test
plays the kubelet only to make a pod end a particular way (`set_pod`, `finish_pods`).
"""

from __future__ import annotations

import contextlib

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from operator_harness import (
    add_node,
    condition,
    delete_job,
    finish_pods,
    job,
    job_doc,
    jobs,
    module_env,
    namespace,
    patch_job,
    pinned_node,
    pods_of,
    reasons,
    set_pod,
    status,
    submit,
    wait_for,
    wait_phase,
    wait_pods,
    wait_running,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def env(seqtrain_operator, tmp_path_factory):
    yield from module_env(seqtrain_operator, tmp_path_factory.mktemp("kube"), operator=True)


def _ns(env, name: str) -> str:
    b, pools = env
    ns = namespace(b.cp, name)
    pools.append(ns)
    return ns


def test_gang_objects_env_volumes_affinity_owners_and_success(env):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-create")
    for i in range(2):
        add_node(cp, f"{ns}-{i}", pool=ns, cpu="4", memory="8Gi", labels={"topology.kubernetes.io/zone": "z1"})
    spread = {"topology": {"policy": "spread", "keys": ["kubernetes.io/hostname"]}}
    created = submit(cp, job_doc("gpt", ns, scheduling=spread))
    uid = created["metadata"]["uid"]
    pods = wait_pods(cp, ns, "gpt", 1, 2)
    st = wait_for(lambda: (s := status(cp, ns, "gpt")).get("attempt") == 1 and s.get("placement") and s,
                  what="placement in status")
    assert st["worldSize"] == 2
    # spread over hostnames: one replica per node, ranks contiguous per replica, domains recorded
    assert sorted(p["node"] for p in st["placement"]) == [f"{ns}-0", f"{ns}-1"]
    assert sorted(tuple(p["ranks"]) for p in st["placement"]) == [(0,), (1,)]
    assert all(p["domain"] == [p["node"]] for p in st["placement"])
    by_name = {p["metadata"]["name"]: p for p in pods}
    assert set(by_name) == {"gpt-1-0", "gpt-1-1"}
    for replica in (0, 1):
        pod = by_name[f"gpt-1-{replica}"]
        assert pod["metadata"]["ownerReferences"][0]["uid"] == uid
        env_vars = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env_vars["RANK"] == str(replica) and env_vars["WORLD_SIZE"] == "2"
        assert env_vars["MASTER_ADDR"] == f"gpt-0.gpt.{ns}.svc"
        node = next(p["node"] for p in st["placement"] if p["replica"] == replica)
        assert pinned_node(pod) == node
        vols = {v["name"] for v in pod["spec"]["volumes"]}
        assert {"config", "dshm", "checkpoints"} <= vols
    # kube-scheduler binds each pod to the node the plan pinned it to
    running = wait_running(cp, ns, "gpt", 1, 2)
    assert {p["metadata"]["name"]: p["spec"]["nodeName"] for p in running} == {
        f"gpt-1-{p['replica']}": p["node"] for p in st["placement"]}
    svc = cp.core.read_namespaced_service("gpt", ns)
    assert svc.spec.cluster_ip == "None" and svc.metadata.owner_references[0].uid == uid
    cm = cp.core.read_namespaced_config_map("gpt-config-1", ns)
    assert cm.metadata.owner_references[0].uid == uid and "config.json" in cm.data
    assert "seqtrain.dev/cleanup" in job(cp, ns, "gpt")["metadata"]["finalizers"]

    wait_phase(cp, ns, "gpt", "Running")
    finish_pods(cp, ns, "seqtrain.dev/job=gpt", exit_code=0)
    st = wait_phase(cp, ns, "gpt", "Succeeded")
    assert st["restarts"] == 0 and st.get("completionTime")
    assert condition(st, "Succeeded")["status"] == "True"
    # events are posted asynchronously, after the status write
    wait_for(lambda: {"GangCreated", "Running", "Succeeded"} <= reasons(cp, ns), what="events")
    # ... about the job object, as `kubectl describe stj` shows them
    assert {(e.involved_object.kind, e.involved_object.name) for e in cp.core.list_namespaced_event(ns).items
            if e.reason in ("GangCreated", "Succeeded")} == {("SeqTrainJob", "gpt")}
    assert b.proxy.count("POST", rf"/namespaces/{ns}/pods$", status=201) == 2  # never a duplicate
    assert b.proxy.count("POST", rf"/namespaces/{ns}/pods$") == 2


def test_no_capacity_no_pods_and_a_condition_then_capacity_starts_gang(env):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-capacity")
    submit(cp, job_doc("big", ns, resources={"gpus": 4, "cpu": "1", "memory": "1Gi"}, training={"globalBatchSize": 8}))
    st = wait_for(lambda: (s := status(cp, ns, "big")).get("phase") == "Scheduling"
                  and condition(s, "Scheduled").get("reason") == "Unschedulable" and s, what="unschedulable")
    msg = condition(st, "Scheduled")["message"]
    assert "need 2 replicas x (4 GPU" in msg and "fits 0" in msg
    assert pods_of(cp, ns, "big") == []  # all or nothing: not a single pod
    add_node(cp, f"{ns}-gpu", pool=ns, cpu="16", memory="64Gi", gpus=8)
    pods = wait_pods(cp, ns, "big", 1, 2)
    assert {pinned_node(p) for p in pods} == {f"{ns}-gpu"}
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    running = wait_running(cp, ns, "big", 1, 2)  # the scheduler agrees: both fit on the node's 8 GPUs
    assert {p["spec"]["nodeName"] for p in running} == {f"{ns}-gpu"}
    wait_for(lambda: "Unschedulable" in reasons(cp, ns), what="Unschedulable event")


def test_a_higher_priority_gang_is_admitted_first_when_room_appears(env):
    """Two gangs wait for the same room: the one whose PriorityClass is higher goes first, though it came later
    (one admission cycle orders every waiting gang: priority, then arrival)."""
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-priority")
    sched = client.SchedulingV1Api(cp.api)
    pc = f"{ns}-high"
    sched.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                 "metadata": {"name": pc}, "value": 1000})
    try:
        big = {"gpus": 4, "cpu": "1", "memory": "1Gi"}
        submit(cp, job_doc("early", ns, resources=big, training={"globalBatchSize": 8}))
        wait_for(lambda: condition(status(cp, ns, "early"), "Scheduled").get("reason") == "Unschedulable",
                 what="the early gang waiting")
        submit(cp, job_doc("urgent", ns, resources=big, training={"globalBatchSize": 8},
                           scheduling={"priorityClassName": pc}))
        wait_for(lambda: condition(status(cp, ns, "urgent"), "Scheduled").get("reason") == "Unschedulable",
                 what="the urgent gang waiting")
        add_node(cp, f"{ns}-gpu", pool=ns, cpu="16", memory="64Gi", gpus=8)  # room for one of the two
        wait_running(cp, ns, "urgent", 1, 2)
        assert pods_of(cp, ns, "early") == []
        assert condition(status(cp, ns, "early"), "Scheduled").get("reason") == "Unschedulable"
    finally:
        # `early` never fits: left waiting, it would become the head of the line after its wait limit
        # (planner/queue.py) and hold back the later tests' gangs of its priority.
        for name in ("early", "urgent"):
            with contextlib.suppress(ApiException):
                delete_job(cp, ns, name)
        sched.delete_priority_class(pc)


def test_placement_honours_the_pod_templates_resources_sidecars_and_node_affinity(env):
    """What the template adds to a pod, kube-scheduler checks: rdma/ib, a sidecar's CPU, a required node affinity.
    Placed by spec.resources alone, both replicas were pinned to the big node without rdma/ib and stayed Pending
    (Insufficient rdma/ib) until PendingTimeout, then were pinned there again."""
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-template")
    add_node(cp, f"{ns}-a", pool=ns, cpu="32", memory="64Gi")  # sorts first, fits both by spec.resources
    for n in ("b", "c"):  # rdma/ib for two replicas, CPU for one with its sidecar (1 + 3 of 6)
        add_node(cp, f"{ns}-{n}", pool=ns, cpu="6", memory="16Gi", labels={"fabric": "ib"},
                 extended={"rdma/ib": "2"})
    add_node(cp, f"{ns}-d", pool=ns, cpu="32", memory="64Gi", labels={"fabric": "eth"}, extended={"rdma/ib": "8"})
    template = {"spec": {
        "containers": [{"name": "trainer", "resources": {"limits": {"rdma/ib": "1"}}},
                       {"name": "shipper", "image": "fluent/fluent-bit:3.1",
                        "resources": {"requests": {"cpu": "3", "memory": "256Mi"}}}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "fabric", "operator": "In", "values": ["ib"]}]}]}}}}}
    submit(cp, job_doc("ib", ns, podTemplate=template))
    running = wait_running(cp, ns, "ib", 1, 2)  # kube-scheduler agrees with every pin
    assert sorted(p["spec"]["nodeName"] for p in running) == [f"{ns}-b", f"{ns}-c"]
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["rdma/ib"] == "1" for p in running)
    # A gang the template's needs cannot fit says so, naming them, and creates no pod.
    submit(cp, job_doc("ib2", ns, podTemplate=template))
    st = wait_for(lambda: condition(s := status(cp, ns, "ib2"), "Scheduled").get("reason") == "Unschedulable"
                  and s, what="unschedulable")
    msg = condition(st, "Scheduled")["message"]
    assert "1 rdma/ib" in msg and "4000m CPU" in msg and "podTemplate node affinity not matched" in msg, msg
    assert pods_of(cp, ns, "ib2") == []


def test_a_gang_that_does_not_fit_shows_its_demand_to_the_autoscaler_and_runs_on_its_node(env):
    """scheduling.autoscale: the gang's pods exist, unpinned and Unschedulable, so an autoscaler sees all of them;
    the test plays the autoscaler and adds a node. Without autoscale no pod is created (the test above), and a
    scale-from-zero pool would never grow. Nothing added within autoscaleTimeoutSeconds: the gang is torn down."""
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-autoscale")
    add_node(cp, f"{ns}-0", pool=ns, cpu="4", memory="8Gi")  # room for one replica of two
    big = {"gpus": 0, "cpu": "3", "memory": "1Gi"}
    submit(cp, job_doc("grow", ns, resources=big, scheduling={"autoscale": True}))
    pods = wait_pods(cp, ns, "grow", 1, 2)
    assert not any((p["spec"].get("affinity") or {}).get("nodeAffinity") for p in pods), pods  # not pinned
    st = wait_for(lambda: condition(s := status(cp, ns, "grow"), "Scheduled").get("reason") == "ScaleUpRequested"
                  and s, what="scale-up requested")
    assert "need 2 replicas x (3000m CPU" in condition(st, "Scheduled")["message"]

    def unschedulable() -> bool:  # what Cluster Autoscaler and Karpenter watch for
        return any(c.get("reason") == "Unschedulable" for p in pods_of(cp, ns, "grow")
                   for c in p["status"].get("conditions") or [] if c["type"] == "PodScheduled")
    wait_for(unschedulable, what="a pod kube-scheduler marked Unschedulable")
    add_node(cp, f"{ns}-1", pool=ns, cpu="4", memory="8Gi")  # the autoscaler's new node
    running = wait_running(cp, ns, "grow", 1, 2)
    assert sorted(p["spec"]["nodeName"] for p in running) == [f"{ns}-0", f"{ns}-1"]
    assert wait_phase(cp, ns, "grow", "Running")["restarts"] == 0

    # No node comes (each replica is larger than a node): past autoscaleTimeoutSeconds the gang is torn down.
    submit(cp, job_doc("stuck", ns, resources={**big, "cpu": "5"},
                       scheduling={"autoscale": True, "autoscaleTimeoutSeconds": 30}))
    wait_pods(cp, ns, "stuck", 1, 2)
    wait_for(lambda: "PendingTimeout" in reasons(cp, ns), 180, what="the gang torn down after 30 s")
    st = status(cp, ns, "stuck")
    assert st.get("restarts", 0) == 0 and st.get("infraRestarts", 0) == 0, st  # waiting is not a failure


def test_pod_failure_restarts_whole_gang_then_max_restarts_fails(env):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-restarts")
    add_node(cp, f"{ns}-0", pool=ns)
    submit(cp, job_doc("r", ns, faultTolerance={"maxRestarts": 1, "backoffSeconds": 0}))
    wait_running(cp, ns, "r", 1, 2)
    wait_phase(cp, ns, "r", "Running")
    set_pod(cp, ns, "r-1-1", "Failed", exit_code=1, message="Traceback: boom")
    wait_pods(cp, ns, "r", 2, 2)  # a whole new gang, attempt 2
    # the old gang goes, the healthy replica included (deleted gracefully; kwok confirms)
    wait_for(lambda: pods_of(cp, ns, "r", 1) == [], what="attempt 1 deleted")
    st = status(cp, ns, "r")
    assert st["restarts"] == 1 and st["infraRestarts"] == 0 and st["attempt"] == 2
    wait_running(cp, ns, "r", 2, 2)
    wait_phase(cp, ns, "r", "Running")
    set_pod(cp, ns, "r-2-0", "Failed", exit_code=1)
    st = wait_phase(cp, ns, "r", "Failed")
    assert "maxRestarts (1) reached" in st["message"] and st["restarts"] == 1
    wait_for(lambda: not [p for p in pods_of(cp, ns, "r", 2) if p["status"].get("phase") == "Running"
                          and not p["metadata"].get("deletionTimestamp")], what="surviving rank deleted")
    assert b.proxy.count("POST", rf"/namespaces/{ns}/pods$") == 4


def test_invalid_config_exit_code_fails_at_once(env):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-permanent")
    add_node(cp, f"{ns}-0", pool=ns)
    submit(cp, job_doc("bad", ns))
    wait_running(cp, ns, "bad", 1, 2)
    set_pod(cp, ns, "bad-1-0", "Failed", exit_code=3)
    st = wait_phase(cp, ns, "bad", "Failed")
    assert st["restarts"] == 0 and "permanent" in st["message"]


def test_a_kubelet_eviction_is_a_disruption_charged_to_no_budget(env):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-evict")
    add_node(cp, f"{ns}-0", pool=ns)
    submit(cp, job_doc("inf", ns, replicas=1))
    wait_running(cp, ns, "inf", 1, 1)
    wait_phase(cp, ns, "inf", "Running")
    # what the kubelet reports when it evicts a pod under node pressure
    set_pod(cp, ns, "inf-1-0", "Failed", exit_code=137, reason="Evicted", message="The node was low on memory.")
    wait_pods(cp, ns, "inf", 2, 1)
    st = status(cp, ns, "inf")
    # the cluster's choice, not the job's or the node's fault (issue 24): no budget spent, the node not avoided
    assert st["infraRestarts"] == 0 and st["restarts"] == 0 and not st.get("failedNodes"), st


@pytest.mark.parametrize(("how", "charged"), [
    # the kubelet refused the pod at admission: its view of the node disagreed with the scheduler's
    ({"reason": "OutOfnvidia.com/gpu", "message": "Node didn't have enough resource: nvidia.com/gpu"}, "infra"),
    # a GPU pod's trainer found no CUDA device (seqtrain.runtime.exitcodes): a driver/device-plugin fault
    ({"exit_code": 5, "message": "seqtrain: no CUDA device visible"}, "infra"),
    # over its memory limit: the user's, with the reason and the fix in the status
    ({"exit_code": 137, "container_reason": "OOMKilled"}, "user"),
], ids=["kubelet-rejected", "no-cuda-device", "oom-killed"])
def test_what_a_kubelet_reports_decides_who_a_restart_is_charged_to(env, how, charged):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-classify")
    add_node(cp, f"{ns}-0", pool=ns)
    add_node(cp, f"{ns}-1", pool=ns)
    submit(cp, job_doc("c", ns, replicas=1))
    node = wait_running(cp, ns, "c", 1, 1)[0]["spec"]["nodeName"]
    wait_phase(cp, ns, "c", "Running")
    set_pod(cp, ns, "c-1-0", "Failed", **how)
    pod2 = wait_pods(cp, ns, "c", 2, 1)[0]
    st = status(cp, ns, "c")
    if charged == "infra":
        assert st["infraRestarts"] == 1 and st["restarts"] == 0 and node in st["failedNodes"], st
        assert pinned_node(pod2) != node  # the node is avoided for a while
    else:
        assert st["restarts"] == 1 and st["infraRestarts"] == 0 and node not in st.get("failedNodes", {}), st
        told = wait_for(lambda: [e.message for e in cp.core.list_namespaced_event(ns).items if e.reason == "OOMKilled"],
                        what="the OOMKilled event")
        assert "spec.resources.memory" in told[0], told  # the fix, named


def stop_kwok_node(cp, name: str) -> None:
    """The node dies the way real nodes do: kwok stops heartbeating it (it manages only nodes labelled type=kwok),
    so the node lifecycle controller marks it NotReady and taints it, and nothing confirms its pods' deletion."""
    cp.core.patch_node(name, {"metadata": {"labels": {"type": "dead"}}})


def fence_node(cp, name: str) -> None:
    """The out-of-service taint: an admin confirms the node is down."""
    taints = cp.core.read_node(name).spec.taints or []
    keep = [cp.api.sanitize_for_serialization(t) for t in taints]
    cp.core.patch_node(name, {"spec": {"taints": [*keep, {"key": "node.kubernetes.io/out-of-service",
                                                           "value": "nodeshutdown", "effect": "NoExecute"}]}})


def test_node_loss_is_an_infrastructure_restart_on_another_node(env):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-nodeloss")
    add_node(cp, f"{ns}-a", pool=ns)
    add_node(cp, f"{ns}-b", pool=ns)
    submit(cp, job_doc("inf", ns, replicas=1))
    first = wait_running(cp, ns, "inf", 1, 1)[0]["spec"]["nodeName"]
    wait_phase(cp, ns, "inf", "Running")
    stop_kwok_node(cp, first)
    # partitioned or dead: the operator cannot tell, and never force-deletes a pod that may still run on that
    # evidence; an admin confirms the node is down (Kubernetes' non-graceful node shutdown)
    wait_for(lambda: condition(status(cp, ns, "inf"), "NodeUnreachable").get("status") == "True", 90,
             what="the NodeUnreachable condition")
    assert [p["metadata"]["name"] for p in pods_of(cp, ns, "inf")] == ["inf-1-0"]
    fence_node(cp, first)
    pod2 = wait_pods(cp, ns, "inf", 2, 1, timeout=90)[0]
    st = status(cp, ns, "inf")
    assert st["infraRestarts"] == 1 and st["restarts"] == 0 and first in st["failedNodes"]
    assert pinned_node(pod2) != first  # the lost node is avoided
    wait_running(cp, ns, "inf", 2, 1)


def test_suspend_and_resume(env):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-suspend")
    add_node(cp, f"{ns}-0", pool=ns)
    submit(cp, job_doc("s", ns))
    wait_running(cp, ns, "s", 1, 2)
    wait_phase(cp, ns, "s", "Running")
    patch_job(cp, ns, "s", {"spec": {"suspend": True}})
    st = wait_phase(cp, ns, "s", "Suspended")
    wait_for(lambda: pods_of(cp, ns, "s") == [], what="gang removed on suspend")
    assert st["restarts"] == 0
    patch_job(cp, ns, "s", {"spec": {"suspend": False}})
    wait_running(cp, ns, "s", 2, 2)
    st = status(cp, ns, "s")
    assert st["restarts"] == 0 and st["infraRestarts"] == 0  # suspending is not a failure


def test_deletion_cleans_up_everything(env):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-delete")
    add_node(cp, f"{ns}-0", pool=ns)
    submit(cp, job_doc("d", ns))
    wait_running(cp, ns, "d", 1, 2)
    delete_job(cp, ns, "d")
    wait_for(lambda: not jobs(cp, ns), what="job gone (finalizer released)")
    wait_for(lambda: pods_of(cp, ns, "d") == [], what="pods gone")
    # the garbage collector removes what the job owned
    wait_for(lambda: not [c for c in cp.core.list_namespaced_config_map(ns).items
                          if c.metadata.name.startswith("d-")], 60, what="ConfigMaps collected")
    wait_for(lambda: not cp.core.list_namespaced_service(ns).items, 60, what="Service collected")


PODGROUP_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "podgroups.scheduling.volcano.sh"},
    "spec": {"group": "scheduling.volcano.sh", "scope": "Namespaced",
             "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup"},
             "versions": [{"name": "v1beta1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_external_gang_scheduler_missing_then_installed(env):
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-volcano")
    ext = client.ApiextensionsV1Api(cp.api)
    try:  # not installed, whatever ran before
        ext.delete_custom_resource_definition(PODGROUP_CRD["metadata"]["name"])
    except ApiException as exc:
        if exc.status != 404:
            raise
    wait_for(lambda: PODGROUP_CRD["metadata"]["name"] not in {c.metadata.name for c in
                                                             ext.list_custom_resource_definition().items},
             what="no Volcano PodGroup CRD")
    submit(cp, job_doc("v", ns, scheduling={"gang": "volcano", "queue": "research"}))
    st = wait_for(lambda: condition(s := status(cp, ns, "v"), "Scheduled").get("reason") == "Unschedulable"
                  and s, what="not-installed condition")
    assert "volcano is not installed" in condition(st, "Scheduled")["message"]
    assert pods_of(cp, ns, "v") == []
    ext.create_custom_resource_definition(PODGROUP_CRD)
    try:
        pods = wait_pods(cp, ns, "v", 1, 2, timeout=60)
        pg = cp.custom.get_namespaced_custom_object("scheduling.volcano.sh", "v1beta1", ns, "podgroups", "v-1")
        assert pg["spec"]["minMember"] == 2 and pg["spec"]["queue"] == "research"
        assert all(p["spec"]["schedulerName"] == "volcano" for p in pods)
        assert all(p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "v-1" for p in pods)
        # no volcano runs here: kube-scheduler leaves pods of another scheduler alone
        assert all(not p["spec"].get("nodeName") for p in pods_of(cp, ns, "v"))
    finally:
        delete_job(cp, ns, "v")
        wait_for(lambda: not jobs(cp, ns), what="volcano job deleted")
        try:
            ext.delete_custom_resource_definition(PODGROUP_CRD["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 404:
                raise


def test_finished_job_is_deleted_with_its_children_after_the_ttl(env):
    """spec.ttlSecondsAfterFinished: a finished job is deleted after its TTL and the garbage collector takes its
    children; a job without a TTL stays."""
    b, _ = env
    cp = b.cp
    ns = _ns(env, "op-ttl")
    for i in range(2):
        add_node(cp, f"{ns}-{i}", pool=ns, cpu="4", memory="8Gi")
    submit(cp, job_doc("keep", ns))
    submit(cp, job_doc("gone", ns, ttlSecondsAfterFinished=2))
    for name in ("keep", "gone"):
        wait_running(cp, ns, name, 1, 2)
        wait_phase(cp, ns, name, "Running")
        finish_pods(cp, ns, f"seqtrain.dev/job={name}", exit_code=0)
        wait_phase(cp, ns, name, "Succeeded")
    wait_for(lambda: [j["metadata"]["name"] for j in jobs(cp, ns)] == ["keep"], timeout=60,
             what="the job with a TTL deleted, the other kept")
    # the garbage collector deletes what the job owned (ownerReferences), in its own time
    wait_for(lambda: pods_of(cp, ns, "gone") == [], timeout=60, what="the deleted job's pods gone")
    wait_for(lambda: [c.metadata.name for c in cp.core.list_namespaced_config_map(ns).items
                      if c.metadata.name.startswith(("keep", "gone"))] == ["keep-config-1"], timeout=60,
             what="only the kept job's ConfigMap left")
    wait_for(lambda: [s.metadata.name for s in cp.core.list_namespaced_service(ns).items] == ["keep"], timeout=60,
             what="only the kept job's Service left")
    assert len(pods_of(cp, ns, "keep")) == 2
    wait_for(lambda: "TTLExpired" in reasons(cp, ns), timeout=30, what="TTLExpired event")
