"""The real kopf operator against the stateful Kubernetes fake over HTTP: the gang's whole life."""

from __future__ import annotations

import pytest
from operator_harness import (
    OperatorThread,
    condition,
    events,
    fake_cluster,
    fast_config,
    job,
    job_doc,
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
    reasons = {r for r, _ in events(cluster, ns)}
    assert {"GangCreated", "Running", "Succeeded"} <= reasons
    assert fake.count("POST", r"/namespaces/create/pods$") == 2  # never a duplicate
