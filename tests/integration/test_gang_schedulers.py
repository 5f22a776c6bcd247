"""The real external gang schedulers on the testbed (scripts/gang-schedulers.sh builds them from their Go modules).

- scheduler-plugins' scheduler (Coscheduling) as a second scheduler: all-or-nothing binding of a seqtrain gang
  with its real PodGroup; a gang that does not fit stays wholly unbound, and binds once room frees.
- Kueue's controller manager (its webhooks called by the apiserver over TLS at 127.0.0.1): a job queued in a
  LocalQueue waits past pendingGraceSeconds without being torn down, is admitted when quota frees, trains,
  survives a SIGKILLed rank with a gang restart, and leaves no pod, finalizer or Workload behind.

The operator is the session's (helm-installed, authenticated as the chart's ServiceAccount). Skipped (with the
command that fixes it) when the schedulers or the control-plane binaries are not built.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from test_gang_crds import FILES
from test_testbed_e2e import RUN_TIMEOUT, cpu_job, job_status, wait_phase

from jobs import make_job
from testbed import gangs
from testbed.fixtures import TB, Operator, Testbed, free_port, unavailable, wait
from testbed.gangs import gang_binaries, install_crds, start, stop

pytestmark = pytest.mark.slow


def pods(tb: Testbed, ns: str, job: str) -> list[dict[str, Any]]:
    return tb.get("pods", namespace=ns, selector=f"seqtrain.dev/job={job}")


# ---- the operator ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def operator(seqtrain_operator: Operator) -> Operator:
    """The session's operator: helm-installed chart, run as the chart's ServiceAccount, so Kueue's pod patches and
    Workload deletes and coscheduling's PodGroup writes pass its RBAC here, as they must on a real cluster."""
    return seqtrain_operator


@pytest.fixture(scope="module")
def ns(testbed: Testbed, operator: Operator) -> str:
    """A namespace with the ReadWriteMany claim `seqtrain-ckpt` (a hostPath PV the node agent maps)."""
    return testbed.checkpoint_namespace("gang")


# ---- coscheduling ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def coscheduler(testbed: Testbed) -> Iterator[None]:
    bins = gang_binaries("scheduler-plugins")
    if "coscheduling" not in FILES:
        unavailable("no scheduler-plugins CRDs: run scripts/gang-crds.sh")
    install_crds(testbed, [yaml.safe_load(p.read_text()) for p in FILES["coscheduling"]])
    cfg = TB / "scheduler-plugins.yaml"
    cfg.write_text(yaml.safe_dump({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False}, "clientConnection": {"kubeconfig": str(testbed.kubeconfig)},
        "profiles": [{"schedulerName": "scheduler-plugins-scheduler",
                      "plugins": {"multiPoint": {"enabled": [{"name": "Coscheduling"}],
                                                 "disabled": [{"name": "PrioritySort"}]}},
                      "pluginConfig": [{"name": "Coscheduling", "args": {"permitWaitingTimeSeconds": 10}}]}]}))
    proc = start(testbed, [str(bins / "scheduler-plugins"), f"--config={cfg}", "--bind-address=127.0.0.1",
                           f"--secure-port={free_port()}"], "scheduler-plugins")
    try:
        wait("scheduler-plugins running", lambda: proc.poll() is None and (TB / "logs" / "scheduler-plugins.log")
             .read_text(errors="replace").count("Starting Kubernetes Scheduler") > 0, 120)
        yield
    finally:
        stop(proc)


def gpu_gang(name: str, replicas: int) -> dict[str, Any]:
    return make_job(name, image="seqtrain/trainer:dev", replicas=replicas,
                    resources={"gpus": 8, "cpu": "1", "memory": "4Gi", "gpuProduct": "NVIDIA-H100-80GB-HBM3"},
                    training={"steps": 10, "globalBatchSize": 8 * replicas, "microBatchSize": 1},
                    scheduling={"gang": "coscheduling", "topology": {"policy": "none"}, "pendingGraceSeconds": 600})


def test_coscheduling_binds_all_or_nothing(testbed: Testbed, operator: Operator, coscheduler: None,
                                           ns: str) -> None:
    # 6 H100 nodes of 8 GPUs (the tainted pool is tolerated: ExtendedResourceToleration adds the toleration to pods
    # that request nvidia.com/gpu): a 3-node gang fits, then a 4-node gang does not (3 nodes left).
    try:
        testbed.apply(gpu_gang("fits", 3), ns)
        wait("fits: all 3 pods bound", lambda: [p for p in pods(testbed, ns, "fits") if p["spec"].get("nodeName")]
             if len([p for p in pods(testbed, ns, "fits") if p["spec"].get("nodeName")]) == 3 else None, 300)
        pg = testbed.get("podgroups.scheduling.x-k8s.io", "fits-1", ns)
        assert pg["spec"]["minMember"] == 3 and "queue" not in pg["spec"]
        testbed.apply(gpu_gang("too-big", 4), ns)
        wait("too-big: its 4 pods created", lambda: len(pods(testbed, ns, "too-big")) == 4, 120)
        # Wait until the scheduler has tried (the PodGroup's pods are reported unschedulable), then check none bound.
        wait("too-big: the scheduler refused the gang", lambda: all(
            any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in p["status"].get("conditions") or [])
            for p in pods(testbed, ns, "too-big")), 120)
        assert [p["spec"].get("nodeName") for p in pods(testbed, ns, "too-big")] == [None] * 4  # none, not 3 of 4
        assert job_status(testbed, ns, "too-big")["conditions"]  # Scheduled=False: Queued (waiting for the scheduler)
        testbed.kubectl("delete", "stj", "fits", "-n", ns, "--wait=true", "--timeout=180s", timeout=240)
        # Deleting pods does not make the plugin retry a refused gang; the operator touches the queued gang's PodGroup
        # (every RETRY_SECONDS), which does: bound well before the scheduler's own 5-minute flush.
        wait("too-big: all 4 bound once room freed", lambda: all(p["spec"].get("nodeName")
                                                               for p in pods(testbed, ns, "too-big")), 240)
        pg = testbed.get("podgroups.scheduling.x-k8s.io", "too-big-1", ns)
        assert "seqtrain.dev/retry-scheduling" in pg["metadata"]["annotations"]
    finally:  # the GPU nodes are free for the tests after this one
        for name in ("fits", "too-big"):
            testbed.kubectl("delete", "stj", name, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=180s",
                            timeout=240)


# ---- Kueue ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["v1beta1+v1beta2", "v1beta2-only"])
def kueue(testbed: Testbed, operator: Operator, request: pytest.FixtureRequest) -> Iterator[str]:
    """Kueue v0.19.2 as it ships (both Workload versions served), then with v1beta1 switched off in its CRDs, as
    Kueue v0.20 ships them. The queue-admit-train scenario runs against both; preemption and TAS only against
    v0.20's, as the operator speaks v1beta2 to both (`workload_api`, unit-tested) and touches the same fields.
    Yields a namespace of its own per variant (a job of the same name would otherwise resume from the other
    variant's checkpoints)."""
    with gangs.kueue(testbed, files=FILES, v1beta1_served=request.param == "v1beta1+v1beta2"):
        yield testbed.checkpoint_namespace("kueue")


def test_kueue_queue_admit_train_restart_and_clean_up(testbed: Testbed, operator: Operator, kueue: str) -> None:
    ns = kueue
    op = operator
    testbed.apply([
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "cpu"},
         "spec": {"nodeLabels": {"node.kubernetes.io/instance-type": "testbed-cpu"}}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": f"cq-{ns}"},
         "spec": {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
             {"name": "cpu", "resources": [{"name": "cpu", "nominalQuota": "1"},
                                           {"name": "memory", "nominalQuota": "64Gi"}]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team", "namespace": ns},
         "spec": {"clusterQueue": f"cq-{ns}"}}])
    # A blocker holds the whole quota: a job queued behind it must wait, gated, without being torn down.
    blocker = cpu_job("blocker")
    blocker["spec"]["training"]["steps"] = 100000
    blocker["spec"]["scheduling"].update({"gang": "kueue", "queue": "team"})
    try:
        testbed.apply(blocker, ns)
        wait_phase(testbed, op, ns, "blocker", "Running")
        job = cpu_job("queued", hold_at_step=15)  # the first gang waits at step 15 for the rank kill below
        job["spec"]["scheduling"].update({"gang": "kueue", "queue": "team", "pendingGraceSeconds": 5})
        testbed.apply(job, ns)
        first = wait("queued: its pods gated by Kueue", lambda: (ps := pods(testbed, ns, "queued")) and len(ps) == 2 and all(
            any(g["name"] == "kueue.x-k8s.io/admission" for g in p["spec"].get("schedulingGates") or []) for p in ps)
            and ps, 120)
        wait("queued: condition Queued", lambda: any(c["type"] == "Scheduled" and c["reason"] == "Queued"
                                                     for c in job_status(testbed, ns, "queued").get("conditions", [])), 60)
        uids = sorted(p["metadata"]["uid"] for p in first)
        since = time.monotonic()

        def kept() -> bool:  # any teardown fails at once; passes once 3 x pendingGraceSeconds went by without one
            now = sorted(p["metadata"]["uid"] for p in pods(testbed, ns, "queued"))
            if now != uids or job_status(testbed, ns, "queued").get("attempt") != 1:
                pytest.fail(f"a queued gang was torn down: pods {now} (were {uids})", pytrace=False)
            return time.monotonic() - since > 15
        wait("queued: kept past pendingGraceSeconds", kept, 120)
        # Quota frees: admitted, trains; a SIGKILLed rank restarts the gang, which Kueue does not queue again.
        testbed.kubectl("delete", "stj", "blocker", "-n", ns, "--wait=true", "--timeout=300s", timeout=360)
        wait("queued past step 15", lambda: (job_status(testbed, ns, "queued").get("progress") or {}).get("step", 0) >= 15,
             RUN_TIMEOUT, 1)
        victim = testbed.get("pods", namespace=ns, selector="seqtrain.dev/job=queued,seqtrain.dev/replica=1")[0]
        pid = testbed.pod_pid(victim["metadata"]["uid"])
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)
        done = wait_phase(testbed, op, ns, "queued", "Succeeded")
        assert done["attempt"] >= 2 and done["restarts"] + done.get("infraRestarts", 0) >= 1, done
        # Nothing left behind once the job is deleted: no pod, no Kueue finalizer, no Workload.
        testbed.kubectl("delete", "stj", "queued", "-n", ns, "--wait=true", "--timeout=300s", timeout=360)
        wait("no pods left", lambda: pods(testbed, ns, "queued") == [] and pods(testbed, ns, "blocker") == [], 300)
        wait("no Workloads left", lambda: testbed.get("workloads.kueue.x-k8s.io", namespace=ns) == [], 120)
    finally:  # a failure above must not leave the blocker training on the CPU nodes for the tests after this one
        for name in ("blocker", "queued"):
            testbed.kubectl("delete", "stj", name, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=300s",
                            timeout=360)


def workload(tb: Testbed, ns: str, job: str) -> dict[str, Any]:
    """The Kueue Workload of a job's pod group (named after the group: `<job>-<uid prefix>`)."""
    items = tb.get("workloads.kueue.x-k8s.io", namespace=ns) or []
    return next((w for w in items if w["metadata"]["name"].startswith(f"{job}-")), {})


def admitted(wl: dict[str, Any]) -> bool:
    return any(c["type"] == "Admitted" and c["status"] == "True" for c in (wl.get("status") or {}).get("conditions", []))


@pytest.mark.parametrize("kueue", ["v1beta2-only"], indirect=True)
def test_kueue_preempts_the_job_with_the_least_work_at_risk(testbed: Testbed, operator: Operator, kueue: str) -> None:
    """Two jobs of one priority fill a ClusterQueue; an urgent one needs the room of one. Kueue takes, of equal
    priorities, the most recently admitted, here the job that saved nothing; with the operator writing each job's
    work at risk as its Workload's priority boost (--kueue-priority-boost-seconds=0.2) it
    takes the one that checkpointed at every step and so loses nothing.

    The operator is restarted for it with the boost on and progress pushed, not polled: every pod here shares this
    machine's network, so two trainers cannot both serve the progress port, and a poll of one job's pod would read
    the other's document."""
    ns = kueue
    def one_replica(name: str, interval: int, priority_class: str | None = None) -> dict[str, Any]:
        job = cpu_job(name, hold_at_step=40)  # trains 40 steps, then holds (no CPU) until it is stopped
        job["spec"]["replicas"] = 1
        job["spec"]["training"]["globalBatchSize"] = 4
        job["spec"]["checkpoint"]["intervalSteps"] = interval
        job["spec"]["scheduling"].update({"gang": "kueue", "queue": "boost", "topology": {"policy": "none"}})
        if priority_class:  # Kueue takes a pod group's priority from its pods' PriorityClass
            job["spec"]["scheduling"]["priorityClassName"] = priority_class
        return job

    def holding(name: str) -> dict[str, Any] | None:
        st = job_status(testbed, ns, name)
        assert st.get("phase") != "Failed", st
        return st if (st.get("progress") or {}).get("step", 0) >= 40 and st.get("workAtRisk") else None

    names = ("saved", "unsaved", "urgent")
    push = free_port()
    operator.stop()
    try:
        operator.start([f"--progress-push-port={push}", f"--progress-push-url=http://127.0.0.1:{push}",
                        "--progress-port=0", "--kueue-priority-boost-seconds=0.2", "--kueue-priority-boost-max=50"])
        testbed.apply([
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "cpu"},
             "spec": {"nodeLabels": {"node.kubernetes.io/instance-type": "testbed-cpu"}}},
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "seqtrain-urgent"},
             "value": 1000},
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": f"cq-boost-{ns}"},
             "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                      "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
                          {"name": "cpu", "resources": [{"name": "cpu", "nominalQuota": "1"},  # two 500m replicas
                                                        {"name": "memory", "nominalQuota": "64Gi"}]}]}]}},
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "boost", "namespace": ns},
             "spec": {"clusterQueue": f"cq-boost-{ns}"}}])
        testbed.apply(one_replica("saved", interval=1), ns)  # a checkpoint at every step: about one step at risk
        saved = wait("saved holding at step 40", lambda: holding("saved"), RUN_TIMEOUT, 1)
        assert saved["workAtRisk"]["steps"] <= 1, saved["workAtRisk"]  # the last save may still be in flight
        testbed.apply(one_replica("unsaved", interval=1000), ns)  # no checkpoint: 40 steps at risk
        unsaved = wait("unsaved holding at step 40", lambda: holding("unsaved"), RUN_TIMEOUT, 1)
        assert unsaved["workAtRisk"]["steps"] >= 40 and unsaved["workAtRisk"]["seconds"] >= 0.2, unsaved["workAtRisk"]
        boost = "kueue.x-k8s.io/priority-boost"

        def boosts() -> tuple[int, int] | None:
            got = [(workload(testbed, ns, n)["metadata"].get("annotations") or {}).get(boost) for n in names[:2]]
            return (int(got[0]), int(got[1])) if None not in got and int(got[1]) > int(got[0]) else None
        wait("both Workloads boosted by their work at risk, the unsaved job's higher", boosts, 60)
        assert admitted(workload(testbed, ns, "saved")) and admitted(workload(testbed, ns, "unsaved"))

        testbed.apply(one_replica("urgent", interval=1000, priority_class="seqtrain-urgent"), ns)
        wait("urgent admitted", lambda: admitted(workload(testbed, ns, "urgent")), 120)
        # the victim: the job that loses nothing, not the most recently admitted one
        assert not admitted(workload(testbed, ns, "saved")), workload(testbed, ns, "saved").get("status")
        assert admitted(workload(testbed, ns, "unsaved")), workload(testbed, ns, "unsaved").get("status")
        said = workload(testbed, ns, "saved")["status"].get("conditions", [])
        assert any("Preempted" in (c["type"], c.get("reason")) for c in said), said
        assert (job_status(testbed, ns, "unsaved").get("attempt"), job_status(testbed, ns, "unsaved").get("restarts")) \
            == (1, 0)
    finally:
        for name in names:
            testbed.kubectl("delete", "stj", name, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=300s",
                            timeout=360)
        testbed.kubectl("delete", "localqueue", "boost", "-n", ns, "--ignore-not-found", timeout=60)
        testbed.kubectl("delete", "clusterqueue", f"cq-boost-{ns}", "--ignore-not-found", timeout=60)
        testbed.kubectl("delete", "priorityclass", "seqtrain-urgent", "--ignore-not-found", timeout=60)
        operator.stop()
        operator.start()  # as the session's other tests expect it


def node_racks(tb: Testbed, pods_: list[dict[str, Any]]) -> dict[str, str]:
    """node -> its example.com/rack label, for the nodes the pods are bound to."""
    nodes = {p["spec"]["nodeName"] for p in pods_}
    return {n: tb.get("nodes", n)["metadata"]["labels"]["example.com/rack"] for n in nodes}


def tas_gang(name: str, replicas: int, policy: str) -> dict[str, Any]:
    job = gpu_gang(name, replicas)
    job["spec"]["scheduling"].update({"gang": "kueue", "queue": "tas", "topology": {
        "policy": policy, "keys": ["topology.kubernetes.io/zone", "example.com/rack"]}})
    return job


@pytest.mark.parametrize("kueue", ["v1beta2-only"], indirect=True)
def test_kueue_tas_puts_a_gang_in_one_rack_waits_when_none_fits_or_spreads_when_preferred(testbed: Testbed, operator: Operator, kueue: str) -> None:
    """scheduling.topology under Kueue is a Topology-Aware Scheduling request: the kwok GPU nodes are 3 racks of 2
    nodes (8 GPUs each; rack-3 tainted, tolerated by GPU pods). `require` by rack puts a 2-node gang in one rack
    and keeps a 3-node gang waiting (no rack has 3 nodes); `pack` (preferred) places a 5-node gang over the 3 racks,
    in rank order: Kueue reads each pod's rank from our replica label, so consecutive ranks share a rack."""
    ns = kueue
    testbed.apply([
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology", "metadata": {"name": f"racks-{ns}"},
         "spec": {"levels": [{"nodeLabel": "topology.kubernetes.io/zone"}, {"nodeLabel": "example.com/rack"},
                             {"nodeLabel": "kubernetes.io/hostname"}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": f"gpu-tas-{ns}"},
         "spec": {"nodeLabels": {"node.kubernetes.io/instance-type": "testbed-gpu"}, "topologyName": f"racks-{ns}"}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": f"cq-tas-{ns}"},
         "spec": {"namespaceSelector": {}, "resourceGroups": [
             {"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": [
                 {"name": f"gpu-tas-{ns}", "resources": [{"name": "cpu", "nominalQuota": "64"},
                                                        {"name": "memory", "nominalQuota": "512Gi"},
                                                        {"name": "nvidia.com/gpu", "nominalQuota": "64"}]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "tas", "namespace": ns},
         "spec": {"clusterQueue": f"cq-tas-{ns}"}}])
    names = ("rack-pair", "rack-three", "spread-five")
    try:
        testbed.apply(tas_gang("rack-pair", 2, "require"), ns)
        pair = wait("rack-pair: both pods bound", lambda: (ps := pods(testbed, ns, "rack-pair")) and len(ps) == 2
                    and all(p["spec"].get("nodeName") for p in ps) and ps, 240)
        racks = node_racks(testbed, pair)
        assert len(racks) == 2 and len(set(racks.values())) == 1, racks  # two nodes, one rack

        testbed.apply(tas_gang("rack-three", 3, "require"), ns)
        wait("rack-three: Kueue says no rack fits it", lambda: any(
            c["type"] == "QuotaReserved" and c["status"] == "False" and "topology" in c.get("message", "").lower()
            for c in (workload(testbed, ns, "rack-three").get("status") or {}).get("conditions", [])), 180)
        assert [p["spec"].get("nodeName") for p in pods(testbed, ns, "rack-three")] == [None] * 3
        for name in ("rack-pair", "rack-three"):
            testbed.kubectl("delete", "stj", name, "-n", ns, "--wait=true", "--timeout=180s", timeout=240)

        testbed.apply(tas_gang("spread-five", 5, "pack"), ns)
        spread = wait("spread-five: all 5 pods bound", lambda: (ps := pods(testbed, ns, "spread-five"))
                      and len(ps) == 5 and all(p["spec"].get("nodeName") for p in ps) and ps, 240)
        racks = node_racks(testbed, spread)
        assert len(racks) == 5 and len(set(racks.values())) == 3, racks  # as few racks as fit: 2 + 2 + 1
        by_rank = sorted(spread, key=lambda p: int(p["metadata"]["labels"]["seqtrain.dev/replica"]))
        # Kueue took each pod's rank from our replica label ...
        assert [p["metadata"]["labels"].get("kueue.x-k8s.io/pod-group-pod-index") for p in by_rank] == [
            str(r) for r in range(5)], [p["metadata"]["labels"] for p in by_rank]
        # ... and filled its racks in rank order: each rack holds a run of consecutive ranks (2, 2, 1)
        layout = [racks[p["spec"]["nodeName"]] for p in by_rank]
        runs = [rack for i, rack in enumerate(layout) if i == 0 or rack != layout[i - 1]]
        assert len(runs) == 3 and sorted(layout.count(r) for r in set(layout)) == [1, 2, 2], layout
    finally:
        for name in names:
            testbed.kubectl("delete", "stj", name, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=180s",
                            timeout=240)
