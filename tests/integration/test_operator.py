"""The real kopf operator against the stateful Kubernetes fake over HTTP: the gang's whole life."""

from __future__ import annotations

import pytest
from k8sfake import wait_for
from operator_harness import (
    OperatorThread,
    condition,
    events,
    fake_cluster,
    fast_config,
    job,
    job_doc,
    pods_of,
    status,
    submit,
    wait_phase,
    wait_pods,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with fake_cluster(tmp_path_factory.mktemp("kube")) as (fake, cluster):
        for i in range(2):
            cluster.add_node(f"worker-{i}", cpu="4", memory="8Gi", labels={"topology.kubernetes.io/zone": "z1"})
        op = OperatorThread(fast_config()).start()
        try:
            yield fake, cluster
        finally:
            op.stop()


def test_gang_objects_env_volumes_affinity_owners_and_success(env):
    fake, cluster = env
    ns = "create"
    spread = {"topology": {"policy": "spread", "keys": ["kubernetes.io/hostname"]}}
    created = submit(cluster, job_doc("gpt", ns, scheduling=spread))
    uid = created["metadata"]["uid"]
    pods = wait_pods(cluster, ns, "gpt", 1, 2)
    st = wait_phase(cluster, ns, "gpt", "Scheduling")
    assert st["attempt"] == 1 and st["worldSize"] == 2
    # spread over hostnames: one replica per node, ranks contiguous per replica, domains recorded
    assert sorted(p["node"] for p in st["placement"]) == ["worker-0", "worker-1"]
    assert sorted(tuple(p["ranks"]) for p in st["placement"]) == [(0,), (1,)]
    assert all(p["domain"] == [p["node"]] for p in st["placement"])
    by_name = {p["metadata"]["name"]: p for p in pods}
    assert set(by_name) == {"gpt-1-0", "gpt-1-1"}
    for replica in (0, 1):
        pod = by_name[f"gpt-1-{replica}"]
        assert pod["metadata"]["ownerReferences"][0]["uid"] == uid
        env_vars = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env_vars["RANK"] == str(replica) and env_vars["WORLD_SIZE"] == "2"
        assert env_vars["MASTER_ADDR"] == "gpt-0.gpt.create.svc"
        node = next(p["node"] for p in st["placement"] if p["replica"] == replica)
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [node]
        vols = {v["name"] for v in pod["spec"]["volumes"]}
        assert {"config", "dshm", "checkpoints"} <= vols
    svc = cluster.get("", "services", ns, "gpt")
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["ownerReferences"][0]["uid"] == uid
    cm = cluster.get("", "configmaps", ns, "gpt-config-1")
    assert cm["metadata"]["ownerReferences"][0]["uid"] == uid and "config.json" in cm["data"]
    assert "seqtrain.dev/cleanup" in job(cluster, ns, "gpt")["metadata"]["finalizers"]

    cluster.run_pods(ns, "seqtrain.dev/job=gpt")
    wait_phase(cluster, ns, "gpt", "Running")
    cluster.finish_pods(ns, "seqtrain.dev/job=gpt", exit_code=0)
    st = wait_phase(cluster, ns, "gpt", "Succeeded")
    assert st["restarts"] == 0 and st.get("completionTime")
    assert condition(st, "Succeeded")["status"] == "True"
    # events are posted asynchronously, after the status write
    wait_for(lambda: {"GangCreated", "Running", "Succeeded"} <= {r for r, _ in events(cluster, ns)}, what="events")
    assert fake.count("POST", r"/namespaces/create/pods$") == 2  # never a duplicate


def test_no_capacity_no_pods_and_a_condition_then_capacity_starts_gang(env):
    fake, cluster = env
    ns = "capacity"
    submit(cluster, job_doc("big", ns, resources={"gpus": 4, "cpu": "1", "memory": "1Gi"},
                            training={"globalBatchSize": 8}))
    st = wait_for(lambda: (s := status(cluster, ns, "big")).get("phase") == "Scheduling"
                  and condition(s, "Scheduled").get("reason") == "Unschedulable" and s, what="unschedulable")
    msg = condition(st, "Scheduled")["message"]
    assert "need 2 replicas x (4 GPU" in msg and "fits 0" in msg
    assert pods_of(cluster, ns, "big") == []  # all or nothing: not a single pod
    cluster.add_node("gpu-a", cpu="16", memory="64Gi", gpus=8)
    pods = wait_pods(cluster, ns, "big", 1, 2)
    assert {p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0]["matchFields"][0]["values"][0] for p in pods} == {"gpu-a"}
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    wait_for(lambda: "Unschedulable" in {r for r, _ in events(cluster, ns)}, what="Unschedulable event")


def test_pod_failure_restarts_whole_gang_then_max_restarts_fails(env):
    fake, cluster = env
    ns = "restarts"
    submit(cluster, job_doc("r", ns, faultTolerance={"maxRestarts": 1, "backoffSeconds": 0}))
    wait_pods(cluster, ns, "r", 1, 2)
    cluster.run_pods(ns, "seqtrain.dev/job=r")
    wait_phase(cluster, ns, "r", "Running")
    cluster.set_pod(ns, "r-1-1", "Failed", exit_code=1, message="Traceback: boom")
    wait_pods(cluster, ns, "r", 2, 2)  # a whole new gang, attempt 2
    assert pods_of(cluster, ns, "r", 1) == []  # the old gang is gone, the healthy replica included
    st = status(cluster, ns, "r")
    assert st["restarts"] == 1 and st["infraRestarts"] == 0 and st["attempt"] == 2
    cluster.run_pods(ns, "seqtrain.dev/attempt=2")
    wait_phase(cluster, ns, "r", "Running")
    cluster.set_pod(ns, "r-2-0", "Failed", exit_code=1)
    st = wait_phase(cluster, ns, "r", "Failed")
    assert "maxRestarts (1) reached" in st["message"] and st["restarts"] == 1
    wait_for(lambda: not [p for p in pods_of(cluster, ns, "r", 2) if p["status"]["phase"] == "Running"],
             what="surviving rank deleted")
    assert fake.count("POST", r"/namespaces/restarts/pods$") == 4


def test_invalid_config_exit_code_fails_at_once(env):
    _, cluster = env
    ns = "permanent"
    submit(cluster, job_doc("bad", ns))
    wait_pods(cluster, ns, "bad", 1, 2)
    cluster.run_pods(ns, "seqtrain.dev/job=bad")
    cluster.set_pod(ns, "bad-1-0", "Failed", exit_code=3)
    st = wait_phase(cluster, ns, "bad", "Failed")
    assert st["restarts"] == 0 and "permanent" in st["message"]


def test_eviction_and_node_loss_are_infrastructure_restarts(env):
    _, cluster = env
    ns = "infra"
    cluster.add_node("flaky", cpu="8", memory="16Gi", labels={"pool": "infra"})
    cluster.add_node("steady", cpu="8", memory="16Gi", labels={"pool": "infra"})
    doc = job_doc("inf", ns, replicas=1, scheduling={"nodeSelector": {"pool": "infra"}})
    submit(cluster, doc)
    pod = wait_pods(cluster, ns, "inf", 1, 1)[0]
    first = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
    cluster.run_pods(ns, "seqtrain.dev/job=inf")
    wait_phase(cluster, ns, "inf", "Running")
    cluster.set_node_ready(first, False)
    pod2 = wait_pods(cluster, ns, "inf", 2, 1)[0]
    st = status(cluster, ns, "inf")
    assert st["infraRestarts"] == 1 and st["restarts"] == 0 and first in st["failedNodes"]
    second = pod2["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
    assert second != first  # the lost node is avoided
    cluster.set_node_ready(first, True)
    cluster.run_pods(ns, "seqtrain.dev/attempt=2")
    wait_phase(cluster, ns, "inf", "Running")
    cluster.set_pod(ns, "inf-2-0", "Failed", reason="Evicted", message="The node was low on memory.")
    wait_pods(cluster, ns, "inf", 3, 1)
    st = status(cluster, ns, "inf")
    assert st["infraRestarts"] == 2 and st["restarts"] == 0


def test_suspend_and_resume(env):
    _, cluster = env
    ns = "suspend"
    submit(cluster, job_doc("s", ns))
    wait_pods(cluster, ns, "s", 1, 2)
    cluster.run_pods(ns, "seqtrain.dev/job=s")
    wait_phase(cluster, ns, "s", "Running")
    res = cluster.res("seqtrain.dev", "seqtrainjobs")
    cluster.store.patch(res, ns, "s", {"spec": {"suspend": True}}, "application/merge-patch+json")
    st = wait_phase(cluster, ns, "s", "Suspended")
    wait_for(lambda: pods_of(cluster, ns, "s") == [], what="gang removed on suspend")
    assert st["restarts"] == 0
    cluster.store.patch(res, ns, "s", {"spec": {"suspend": False}}, "application/merge-patch+json")
    wait_pods(cluster, ns, "s", 2, 2)
    st = status(cluster, ns, "s")
    assert st["restarts"] == 0 and st["infraRestarts"] == 0  # suspending is not a failure


def test_deletion_cleans_up_everything(env):
    fake, cluster = env
    ns = "delete"
    submit(cluster, job_doc("d", ns))
    wait_pods(cluster, ns, "d", 1, 2)
    res = cluster.res("seqtrain.dev", "seqtrainjobs")
    cluster.store.delete(res, ns, "d")
    wait_for(lambda: not cluster.list("seqtrain.dev", "seqtrainjobs", ns), what="job gone (finalizer released)")
    assert pods_of(cluster, ns, "d") == []
    assert cluster.list("", "configmaps", ns) == [] and cluster.list("", "services", ns) == []


def test_external_gang_scheduler_missing_then_installed(env):
    _, cluster = env
    ns = "volcano"
    submit(cluster, job_doc("v", ns, scheduling={"gang": "volcano", "queue": "research"}))
    st = wait_for(lambda: condition(s := status(cluster, ns, "v"), "Scheduled").get("reason") == "Unschedulable"
                  and s, what="not-installed condition")
    assert "volcano is not installed" in condition(st, "Scheduled")["message"]
    assert pods_of(cluster, ns, "v") == []
    cluster.install_simple_crd("scheduling.volcano.sh", "podgroups", "PodGroup", version="v1beta1")
    pods = wait_pods(cluster, ns, "v", 1, 2, timeout=30)
    pg = cluster.get("scheduling.volcano.sh", "podgroups", ns, "v-1")
    assert pg["spec"]["minMember"] == 2 and pg["spec"]["queue"] == "research"
    assert all(p["spec"]["schedulerName"] == "volcano" for p in pods)
    assert all(p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "v-1" for p in pods)
