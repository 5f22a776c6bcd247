"""End to end on the real control plane (scripts/testbed.sh): what tests/e2e/kind-e2e.sh does on kind, here.

The chart is helm-installed, the operator runs locally as the chart's ServiceAccount, the apiserver calls its
webhook over TLS, kube-scheduler binds the pods, the node agent runs the CPU ranks as real processes (they really
train) and kwok "runs" the GPU pods (placement only).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
from typing import Any

import pytest
import yaml

from jobs import make_job
from testbed.fixtures import RELEASE, RELEASE_NS, ROOT, TB, Operator, Testbed, wait

pytestmark = pytest.mark.slow

STEPS = 60  # the example's; run 2 needs time left after its checkpoint at step 10 to be killed in
RUN_TIMEOUT = 900  # seconds for a 2-rank CPU run on a loaded 2-core machine; a deadline, not a measurement


def cpu_job(name: str, hold_at_step: int | None = None) -> dict[str, Any]:
    """examples/k8s-cpu.yaml, fewer steps, kept on the agent's CPU nodes (kwok's GPU nodes would not run it).
    `hold_at_step`: the first gang holds after that step until it is terminated (seqtrain.runtime.faults), so a
    test acts "during training" however fast this machine runs the rest; restarted gangs run clean."""
    job = yaml.safe_load((ROOT / "examples" / "k8s-cpu.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"]["training"]["steps"] = STEPS
    job["spec"]["scheduling"]["nodeSelector"] = {"node.kubernetes.io/instance-type": "testbed-cpu"}
    if hold_at_step is not None:
        hold = [{"name": "SEQTRAIN_FAULT_HOLD_AT_STEP", "value": f"{hold_at_step}:900"},
                {"name": "SEQTRAIN_FAULT_ATTEMPT", "value": "1"}]
        job["spec"]["podTemplate"] = {"spec": {"containers": [{"name": "trainer", "env": hold}]}}
    return job


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    """A namespace with the ReadWriteMany claim `seqtrain-ckpt` the example names: a hostPath PV on this machine
    (the node agent maps the claim to its PV's folder), bound by the controller-manager's PV controller."""
    return testbed.checkpoint_namespace("e2e")


def job_status(tb: Testbed, ns: str, name: str) -> dict[str, Any]:
    return ((tb.get("seqtrainjob", name, ns) or {}).get("status")) or {}


def wait_phase(tb: Testbed, op: Operator, ns: str, name: str, phase: str, timeout: float = RUN_TIMEOUT) -> dict:
    def probe() -> dict | None:
        st = job_status(tb, ns, name)
        if st.get("phase") == "Failed" and phase != "Failed":
            pytest.fail(f"{name} failed: {st.get('message')}\noperator log:\n{op.logs()}", pytrace=False)
        return st if st.get("phase") == phase else None
    return wait(f"{name} {phase}", probe, timeout, interval=2)


def losses(ns: str, job: str) -> dict[int, float]:
    """step -> loss from the run's metrics.jsonl (the workdir is on the claim); a step twice is an error."""
    out: dict[int, float] = {}
    for line in (TB / "volumes" / ns / job / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["step"] not in out, f"step {rec['step']} appears twice in {job}'s metrics.jsonl"
        out[rec["step"]] = rec["loss"]
    return out


@pytest.mark.timeout(2 * RUN_TIMEOUT + 300)
def test_cpu_job_trains_and_a_killed_rank_restarts_the_gang_from_its_checkpoint(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    op = seqtrain_operator
    # Run 1, uninterrupted: the reference.
    testbed.apply(cpu_job("cpu-ref"), ns)

    def running_pods() -> list[dict] | None:
        pods = testbed.get("pods", namespace=ns, selector="seqtrain.dev/job=cpu-ref")
        live = [p for p in pods if p["status"].get("phase") == "Running"]
        return live if len(live) == 2 else None
    pods = wait("cpu-ref's two pods Running", running_pods, RUN_TIMEOUT)
    # kube-scheduler bound them (spread: one per agent node), the agent runs them and reports like a kubelet.
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["cpu-0", "cpu-1"]
    for p in pods:
        assert p["status"]["podIP"] == "127.0.0.1"
        assert p["status"]["containerStatuses"][0]["ready"] is True
        assert {c["type"]: c["status"] for c in p["status"]["conditions"]}["PodScheduled"] == "True"
        assert testbed.pod_pid(p["metadata"]["uid"]) is not None
    done = wait_phase(testbed, op, ns, "cpu-ref", "Succeeded")
    assert done["progress"]["step"] == STEPS
    table = testbed.kubectl("get", "stj", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "REPLICAS", "STEP", "LOSS", "TOK/S", "ETA", "RESTARTS", "AGE"]
    row = next(r.split() for r in table[1:] if r.startswith("cpu-ref "))
    assert row[1:4] == ["Succeeded", "2", f"{STEPS}/{STEPS}"]
    reference = losses(ns, "cpu-ref")
    assert sorted(reference) == list(range(1, STEPS + 1))

    # Run 2: SIGKILL one rank's process once it is past the checkpoint at step 10 (held there).
    testbed.apply(cpu_job("cpu-kill", hold_at_step=12), ns)
    metrics = TB / "volumes" / ns / "cpu-kill" / "metrics.jsonl"  # read where the ranks write it: no lag
    wait("cpu-kill past its first checkpoint (step 10)",
         lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 12, RUN_TIMEOUT, 0.5)
    victim = testbed.get("pods", namespace=ns, selector="seqtrain.dev/job=cpu-kill,seqtrain.dev/replica=1")[0]
    pid = testbed.pod_pid(victim["metadata"]["uid"])
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    done = wait_phase(testbed, op, ns, "cpu-kill", "Succeeded")
    assert done["attempt"] >= 2, done
    assert done["restarts"] + done.get("infraRestarts", 0) >= 1, done
    # The killed pod was reported the way a kubelet reports a SIGKILL: exit 137 (the pod object may be gone by now).
    events = testbed.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    assert "cpu-kill" in events
    # The loss continues exactly: every step once, the same losses as the uninterrupted run.
    assert losses(ns, "cpu-kill") == reference


def test_an_invalid_job_is_refused_by_the_webhook_naming_the_field(testbed: Testbed, seqtrain_operator: Operator,
                                                                   ns: str) -> None:
    out = testbed.apply(INVALID, ns, check=False)
    assert out.returncode != 0
    assert 'admission webhook "validate.seqtrainjobs.seqtrain.dev" denied the request' in out.stderr, out.stderr
    assert "spec.training.globalBatchSize" in out.stderr
    assert testbed.get("seqtrainjob", "invalid", ns) is None


def gpu_job(name: str, policy: str) -> dict[str, Any]:
    return make_job(name, image="seqtrain/trainer:dev", replicas=2,
                    resources={"gpus": 8, "cpu": "1", "memory": "4Gi", "gpuProduct": "NVIDIA-H100-80GB-HBM3"},
                    training={"steps": 10, "globalBatchSize": 16, "microBatchSize": 1},
                    scheduling={"topology": {"policy": policy, "keys": ["example.com/rack"]}})


@pytest.mark.parametrize("policy", ["require", "spread"])
def test_a_gpu_job_lands_where_its_topology_policy_says(testbed: Testbed, seqtrain_operator: Operator, ns: str,
                                                        policy: str) -> None:
    name = f"gpu-{policy}"
    testbed.apply(gpu_job(name, policy), ns)

    def bound() -> list[dict] | None:
        pods = testbed.get("pods", namespace=ns, selector=f"seqtrain.dev/job={name}")
        ok = [p for p in pods if p["spec"].get("nodeName") and p["status"].get("phase") == "Running"]
        return ok if len(ok) == 2 else None
    pods = wait(f"{name}'s pods bound and Running on kwok nodes", bound, 300)
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert len(nodes) == 2  # 8 GPUs each: one whole node per replica
    racks = {testbed.get("node", n)["metadata"]["labels"]["example.com/rack"] for n in nodes}
    assert len(racks) == (1 if policy == "require" else 2), (policy, nodes, racks)
    placement = {a["node"] for a in job_status(testbed, ns, name)["placement"]}
    assert placement == nodes  # the operator's plan is what kube-scheduler bound
    testbed.kubectl("delete", "stj", name, "-n", ns, "--wait=true", "--timeout=180s", timeout=240)
    wait(f"{name}'s pods gone", lambda: testbed.get("pods", namespace=ns, selector=f"seqtrain.dev/job={name}") == [],
         180)


def leftovers(tb: Testbed) -> list[str]:
    """Everything the release or its jobs could leave behind, as `kind/namespace/name` strings."""
    found = []
    kinds = ("deployment", "serviceaccount", "secret", "service", "role", "rolebinding", "configmap", "clusterrole",
             "clusterrolebinding", "validatingwebhookconfiguration", "kopfpeering", "clusterkopfpeering",
             "jobs.batch", "pods")  # the uninstall hook's Job and pod
    for kind in kinds:
        found += items(tb, kind, f"app.kubernetes.io/instance={RELEASE}")
    for kind in ("pods", "configmaps", "services"):
        found += items(tb, kind, "seqtrain.dev/job")
    found += items(tb, "seqtrainjobs", None)
    return found


def items(tb: Testbed, kind: str, selector: str | None) -> list[str]:
    out = tb.kubectl("get", kind, "-A", *(["-l", selector] if selector else []), "-o", "json", check=False)
    if out.returncode != 0:
        assert "doesn't have a resource type" in out.stderr, out.stderr  # e.g. no kopf peering CRD installed
        return []
    return [f"{kind}/{o['metadata'].get('namespace', '')}/{o['metadata']['name']}"
            for o in json.loads(out.stdout)["items"]]


INVALID = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "invalid"},
           "spec": {"replicas": 2, "training": {"globalBatchSize": 3, "microBatchSize": 1}}}


def test_helm_upgrade_then_uninstall_leave_nothing_behind(testbed: Testbed, seqtrain_operator: Operator,
                                                          ns: str) -> None:
    op = seqtrain_operator
    testbed.apply(gpu_job("gpu-upgrade", "none"), ns)
    wait("gpu-upgrade's pods", lambda: len(testbed.get("pods", namespace=ns,
                                                      selector="seqtrain.dev/job=gpu-upgrade")) == 2, 300)
    # Upgrade with a changed value: the webhook keeps answering, the job keeps its gang.
    testbed.helm("upgrade", RELEASE, str(ROOT / "charts" / "seqtrain"), "--namespace", RELEASE_NS, *op.values(),
                 "--set", "operator.terminationGraceSeconds=60", "--wait", "--timeout", "180s", timeout=300)
    refused = testbed.apply(INVALID, ns, check=False)
    assert refused.returncode != 0 and "spec.training.globalBatchSize" in refused.stderr, refused.stderr
    assert job_status(testbed, ns, "gpu-upgrade").get("phase") in ("Scheduling", "Running", "Pending")
    before = copy.deepcopy(job_status(testbed, ns, "gpu-upgrade"))
    # The other jobs go while the operator runs (its finalizer stops their pods gracefully) ...
    testbed.kubectl("delete", "seqtrainjobs", "-A", "--field-selector", "metadata.name!=gpu-upgrade", "--wait=true",
                    "--timeout=300s", timeout=360)
    assert "seqtrain.dev/cleanup" in testbed.get("seqtrainjob", "gpu-upgrade", ns)["metadata"]["finalizers"]
    # ... this one stays for the uninstall, the operator gone first (as the Deployment goes): the chart's post-delete
    # hook (a Job the node agent runs, as the hook's own ServiceAccount) releases the finalizer; the job stays.
    op.stop()
    try:
        testbed.helm("uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", "--timeout", "240s", timeout=360)
        kept = testbed.get("seqtrainjob", "gpu-upgrade", ns)
        assert kept is not None and "seqtrain.dev/cleanup" not in (kept["metadata"].get("finalizers") or []), kept
        # ... and it can be deleted with no operator: its pods go with it (ownerReferences)
        testbed.kubectl("delete", "stj", "gpu-upgrade", "-n", ns, "--wait=true", "--timeout=120s", timeout=180)
        def nothing_left() -> bool:
            if left := leftovers(testbed):
                raise AssertionError(f"left: {left}")  # wait() reports the last probe's exception
            return True
        wait("nothing left of the release and its jobs", nothing_left, 180)
    finally:
        op.install()  # the session's operator comes back for whatever runs next
        op.start()
    assert before  # the job was reconciled before the upgrade


def test_up_is_idempotent_and_status_says_what_runs(testbed: Testbed) -> None:
    again = testbed.run(str(ROOT / "scripts" / "testbed.sh"), "up", timeout=300)
    assert f"KUBECONFIG={testbed.kubeconfig}" in again.stdout
    status = testbed.run(str(ROOT / "scripts" / "testbed.sh"), "status").stdout
    for component in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "node-agent"):
        assert f"{component} running" in status
    nodes = {n["metadata"]["name"]: n for n in testbed.get("nodes")}
    assert {"cpu-0", "cpu-1", "gpu-a-0", "gpu-t-0"} <= set(nodes)
    assert nodes["gpu-t-0"]["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    assert nodes["gpu-a-0"]["status"]["allocatable"]["nvidia.com/gpu"] == "8"


def test_node_down_leaves_its_pod_terminating_until_node_up(testbed: Testbed) -> None:
    """A dead node: NotReady by the node lifecycle controller, its pod evicted but never confirmed gone (no kubelet
    answers); back up, the agent confirms the deletion."""
    name = testbed.namespace("node")
    testbed.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
                   "spec": {"nodeSelector": {"kubernetes.io/hostname": "cpu-1"}, "restartPolicy": "Never",
                            "terminationGracePeriodSeconds": 5,
                            "containers": [{"name": "c", "image": "none",
                                            "command": [sys.executable, "-c", "import time; time.sleep(900)"]}]}},
                  name)
    pod = wait("sleeper Running", lambda: (p := testbed.get("pod", "sleeper", name)) and
               p["status"].get("phase") == "Running" and p, 180)
    pid = testbed.pod_pid(pod["metadata"]["uid"])
    assert pid is not None
    testbed.node_down("cpu-1")
    try:
        with pytest.raises(ProcessLookupError):  # its processes died with it
            os.killpg(pid, 0)

        def unreachable() -> bool:
            node = testbed.get("node", "cpu-1")
            ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
            taints = {t["key"] for t in node["spec"].get("taints") or []}
            return ready == "Unknown" and "node.kubernetes.io/unreachable" in taints
        wait("cpu-1 unreachable (node lifecycle controller)", unreachable, 180)
        evicted = wait("sleeper evicted", lambda: (p := testbed.get("pod", "sleeper", name))
                       and p["metadata"].get("deletionTimestamp") and p, 180)
        assert evicted["metadata"]["uid"] == pod["metadata"]["uid"]  # still there: nobody confirms on a dead node
    finally:
        testbed.node_up("cpu-1")
    wait("sleeper's deletion confirmed after node-up", lambda: testbed.get("pod", "sleeper", name) is None, 180)
    wait("cpu-1 Ready again", lambda: {c["type"]: c["status"] for c in testbed.get("node", "cpu-1")["status"][
        "conditions"]}["Ready"] == "True", 180)
