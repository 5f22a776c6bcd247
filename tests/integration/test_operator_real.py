"""The operator's defects of issue 11, each on the real control plane (scripts/testbed.sh): kube-apiserver with the
production admission chain, kube-scheduler, the node lifecycle controller, kwok GPU nodes and the node agent.

The chart is helm-installed and the operator runs as its ServiceAccount (tests/testbed/fixtures.py); every wait has
a deadline and no assertion is about timing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any

import pytest
import yaml
from test_testbed_e2e import cpu_job, job_status, losses, wait_phase

from jobs import make_job
from testbed.fixtures import RELEASE, RELEASE_NS, ROOT, TB, Operator, Testbed, wait

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 900  # a deadline for a 2-rank CPU run on a loaded 2-core machine, not a measurement
SA = f"system:serviceaccount:{RELEASE_NS}:seqtrain"


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    """A namespace with the ReadWriteMany claim `seqtrain-ckpt` (a hostPath PV the node agent maps)."""
    return testbed.checkpoint_namespace("op")


def gpu_job(name: str, replicas: int = 1, gpus: int = 8, **scheduling: Any) -> dict[str, Any]:
    """A GPU job for kwok's nodes (placement only: kwok "runs" the pods)."""
    return make_job(name, image="seqtrain/trainer:dev", replicas=replicas,
                    resources={"gpus": gpus, "cpu": "1", "memory": "4Gi"},
                    training={"steps": 10, "globalBatchSize": 8 * replicas * gpus, "microBatchSize": 1},
                    scheduling={"topology": {"policy": "none"}, **scheduling})


def pods_of(tb: Testbed, ns: str, job: str) -> list[dict]:
    return tb.get("pods", namespace=ns, selector=f"seqtrain.dev/job={job}")


def condition(tb: Testbed, ns: str, job: str, type_: str) -> dict[str, Any] | None:
    return next((c for c in job_status(tb, ns, job).get("conditions", []) if c["type"] == type_), None)


def events(tb: Testbed, ns: str, job: str) -> list[dict]:
    out = tb.kubectl("get", "events", "-n", ns, "--field-selector", f"involvedObject.name={job}", "-o", "json")
    return json.loads(out.stdout)["items"]


def delete_job(tb: Testbed, ns: str, name: str) -> None:
    tb.kubectl("delete", "stj", name, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=180s", timeout=240)


# ---- 1. a dead node; 4. its peer's echo is not the user's --------------------------------------------------------


def test_node_loss_force_deletes_restarts_from_the_checkpoint_charged_to_infrastructure(
        testbed: Testbed, seqtrain_operator: Operator, ns: str, node_back: list[str]) -> None:
    job = cpu_job("node-loss", hold_at_step=15)  # past the checkpoint of step 10: the node dies during training
    job["spec"]["training"]["steps"] = 40
    job["spec"]["faultTolerance"]["maxRestarts"] = 0  # a restart charged to the user would fail the job
    testbed.apply(job, ns)
    wait("node-loss held at step 15, past its first checkpoint",
         lambda: (job_status(testbed, ns, "node-loss").get("progress") or {}).get("step", 0) >= 15, RUN_TIMEOUT, 1)
    victim = next(p for p in pods_of(testbed, ns, "node-loss") if p["metadata"]["labels"]["seqtrain.dev/replica"] == "1")
    dead = victim["spec"]["nodeName"]
    node_back.append(dead)
    testbed.node_down(dead)
    # Dead or only partitioned? The operator cannot tell: pods that may still run (and write checkpoints) are never
    # force-deleted on that evidence. The gang waits, saying how to end the wait; an admin confirms the node is down.
    waiting = wait("the NodeUnreachable condition", lambda: (c := condition(testbed, ns, "node-loss", "NodeUnreachable"))
                   and c["status"] == "True" and c, RUN_TIMEOUT, 1)
    assert dead in waiting["message"] and "out-of-service" in waiting["message"], waiting
    assert testbed.get("pod", victim["metadata"]["name"], ns) is not None
    testbed.fence(dead)
    done = wait_phase(testbed, seqtrain_operator, ns, "node-loss", "Succeeded")
    assert done["infraRestarts"] >= 1 and done.get("restarts", 0) == 0, done
    assert dead in done.get("failedNodes", {}), done
    assert done["attempt"] >= 2
    # The new gang avoided the dead node and resumed from the checkpoint: every step once, none lost past it.
    assert all(p["node"] != dead for p in done["placement"]), done["placement"]
    assert sorted(losses(ns, "node-loss")) == list(range(1, 41))
    # The taint manager evicted the pod of the NotReady node (DisruptionTarget DeletionByTaintManager), or the
    # operator's node-lost grace ran out first: either way the restart says the node was lost.
    restarted = [e for e in events(testbed, ns, "node-loss") if e["reason"] in ("NodeLost", "NodeUnreachable")]
    # (NodeUnreachable says "on unreachable node(s) <node>", NodeLost "on <node>": either names the node)
    assert restarted and all(dead in e["message"] for e in restarted), events(testbed, ns, "node-loss")


# ---- 3. names ----------------------------------------------------------------------------------------------------


def test_a_name_the_service_cannot_take_is_refused_at_admission_naming_the_field(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    out = testbed.apply(gpu_job("7b-llama"), ns, check=False)
    assert out.returncode != 0 and "metadata.name" in out.stderr and "DNS-1035" in out.stderr, out.stderr
    assert testbed.get("seqtrainjob", "7b-llama", ns) is None


# ---- 5. admission agrees with kube-scheduler ---------------------------------------------------------------------


def test_two_jobs_competing_for_one_nodes_gpus_are_never_both_admitted(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    pin = {"nodeSelector": {"kubernetes.io/hostname": "gpu-a-3"}}
    testbed.apply([gpu_job("race-a", **pin), gpu_job("race-b", **pin)], ns)
    try:
        def settled() -> tuple[str, str] | None:
            a, b = (condition(testbed, ns, j, "Scheduled") for j in ("race-a", "race-b"))
            reasons = sorted(((c or {}).get("reason", ""), j) for c, j in ((a, "race-a"), (b, "race-b")))
            return (reasons[0][1], reasons[1][1]) if [r for r, _ in reasons] == ["GangRunning", "Unschedulable"] \
                else None
        winner, loser = wait("one job running, the other Unschedulable", settled, 300)
        assert len(pods_of(testbed, ns, winner)) == 1 and pods_of(testbed, ns, loser) == []
        msg = condition(testbed, ns, loser, "Scheduled")["message"]
        assert "need 1 replicas x (8 GPU" in msg, msg
        wait("the Unschedulable warning", lambda: any(e["reason"] == "Unschedulable" and e["type"] == "Warning"
                                                      for e in events(testbed, ns, loser)), 60)
        # The winner finishing frees the node: the loser is admitted.
        delete_job(testbed, ns, winner)
        wait(f"{loser} admitted once the node is free",
             lambda: (condition(testbed, ns, loser, "Scheduled") or {}).get("reason") == "GangRunning", 300)
    finally:
        delete_job(testbed, ns, "race-a")
        delete_job(testbed, ns, "race-b")


def test_a_gpu_pool_tainted_like_managed_clouds_works(testbed: Testbed, seqtrain_operator: Operator,
                                                      ns: str) -> None:
    job = gpu_job("tainted", **{"nodeSelector": {"topology.kubernetes.io/zone": "zone-b"}})
    testbed.apply(job, ns)
    try:
        def running() -> list[dict] | None:
            pods = [p for p in pods_of(testbed, ns, "tainted") if p["status"].get("phase") == "Running"]
            return pods or None
        (pod,) = wait("the tainted pool's pod bound and Running", running, 300)
        assert pod["spec"]["nodeName"].startswith("gpu-t-")
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    finally:
        delete_job(testbed, ns, "tainted")


# ---- 6. partial gangs --------------------------------------------------------------------------------------------


def test_a_gang_refused_partway_by_a_quota_is_torn_down_reported_and_retried(
        testbed: Testbed, seqtrain_operator: Operator) -> None:
    ns = testbed.namespace("quota")
    testbed.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "two-pods"},
                   "spec": {"hard": {"pods": "1"}}}, ns)
    job = gpu_job("partial", replicas=2)
    job["spec"]["faultTolerance"] = {"backoffSeconds": 1, "maxBackoffSeconds": 5}
    testbed.apply(job, ns)

    def refused() -> dict | None:
        c = condition(testbed, ns, "partial", "Scheduled")
        return c if c and c.get("reason") == "CreateFailed" else None
    c = wait("the Scheduled condition saying the quota refused the gang", refused, 300)
    assert "exceeded quota" in c["message"], c
    wait("the CreateFailed event", lambda: any(e["reason"] == "CreateFailed" and "exceeded quota" in e["message"]
                                               for e in events(testbed, ns, "partial")), 60)
    wait("the partial gang torn down", lambda: not [p for p in pods_of(testbed, ns, "partial")
                                                   if not p["metadata"].get("deletionTimestamp")], 120)
    st = job_status(testbed, ns, "partial")
    assert st.get("restarts", 0) == 0 and st.get("infraRestarts", 0) == 0 and st["createFailures"] >= 1
    # Raise the quota: the next retry creates the whole gang.
    testbed.kubectl("patch", "resourcequota", "two-pods", "-n", ns, "--type=merge", "-p",
                    '{"spec":{"hard":{"pods":"4"}}}')
    wait("the whole gang created after the quota was raised", lambda: len(pods_of(testbed, ns, "partial")) == 2, 300)
    delete_job(testbed, ns, "partial")


# ---- 7. RBAC: exactly what is used -------------------------------------------------------------------------------


def can_i(tb: Testbed, namespace: str | None) -> dict[str, set[str]]:
    """`kubectl auth can-i --list` as the chart's ServiceAccount: resource -> verbs."""
    args = ["auth", "can-i", "--list", f"--as={SA}"] + (["-n", namespace] if namespace else [])
    grants: dict[str, set[str]] = {}
    for line in tb.kubectl(*args).stdout.splitlines()[1:]:
        m = re.match(r"^(\S+)\s+\[.*\]\s+\[.*\]\s+\[([^\]]*)\]\s*$", line)
        if m and not m.group(1).startswith("["):  # resource rows; non-resource URL rows start with "["
            grants.setdefault(m.group(1), set()).update(m.group(2).split())
    return grants


def test_the_service_account_can_do_exactly_what_the_operator_does(testbed: Testbed, seqtrain_operator: Operator,
                                                                   ns: str) -> None:
    g = can_i(testbed, ns)
    assert g["seqtrainjobs.seqtrain.dev/finalizers"] == {"update"}
    assert g["seqtrainjobs.seqtrain.dev/status"] == {"patch"}
    assert g["seqtrainjobs.seqtrain.dev"] == {"get", "list", "watch", "patch", "delete"}  # delete: TTL
    # get, delete: a name a deleted job's namesake still holds (Kube.create reads whose it is, deletes it by uid)
    assert g["pods"] == {"get", "list", "watch", "create", "delete", "deletecollection", "patch"}  # patch: Kueue
    assert g["workloads.kueue.x-k8s.io"] == {"delete", "patch"}  # patch: the work at risk as priority boost
    assert g["podgroups.scheduling.x-k8s.io"] == {"get", "create", "delete", "patch"}  # patch: coscheduling
    assert g["podgroups.scheduling.volcano.sh"] == {"get", "create", "delete"}
    assert g["services"] == {"get", "create", "delete"}
    assert g["configmaps"] == {"get", "create", "delete", "deletecollection"}
    assert g["persistentvolumeclaims"] == {"get"}  # the webhook: the checkpoint claim's access modes
    assert g["poddisruptionbudgets.policy"] == {"get", "create", "delete"}  # scheduling.podDisruptionBudget
    assert g["namespaces"] == {"list", "watch"} and g["nodes"] == {"list", "watch"}
    assert g["secrets"] == {"create"}  # progressPush: each attempt's token Secret; never read, listed or deleted
    assert "*" not in g and "deployments.apps" not in g


# ---- 8. webhook --------------------------------------------------------------------------------------------------


def test_a_stored_job_that_fails_todays_rules_can_still_be_deleted(testbed: Testbed, seqtrain_operator: Operator,
                                                                   ns: str) -> None:
    """Stored while no webhook answered (an older operator's rules); the finalizer patch must pass the webhook."""
    testbed.kubectl("delete", "validatingwebhookconfiguration", "seqtrain")
    try:
        bad = gpu_job("stored-bad")
        bad["spec"]["training"]["globalBatchSize"] = 3  # the webhook refuses this; the CRD schema does not
        testbed.apply(bad, ns)
    finally:
        seqtrain_operator.install()  # helm puts the webhook back
    wait("the operator marked it Failed (InvalidSpec) and holds its finalizer", lambda: (
        job_status(testbed, ns, "stored-bad").get("phase") == "Failed"
        and (testbed.get("seqtrainjob", "stored-bad", ns) or {}).get("metadata", {}).get("finalizers")), 120)
    delete_job(testbed, ns, "stored-bad")
    assert testbed.get("seqtrainjob", "stored-bad", ns) is None


def test_helm_upgrade_keeps_the_webhook_certificate(testbed: Testbed, seqtrain_operator: Operator) -> None:
    before = testbed.get("secret", "seqtrain-webhook-tls", RELEASE_NS)["data"]
    testbed.helm("upgrade", RELEASE, str(ROOT / "charts" / "seqtrain"), "--namespace", RELEASE_NS,
                 *seqtrain_operator.values(), "--wait", "--timeout", "180s", timeout=300)
    assert testbed.get("secret", "seqtrain-webhook-tls", RELEASE_NS)["data"] == before


# ---- 10. spec and status -----------------------------------------------------------------------------------------


def test_cel_rules_refuse_changing_a_running_gang_and_the_apiserver_agrees_on_quantities(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    testbed.apply(gpu_job("frozen", gpus=1), ns)
    try:
        wait("frozen Running", lambda: job_status(testbed, ns, "frozen").get("phase") == "Running", 300)
        out = testbed.kubectl("patch", "stj", "frozen", "-n", ns, "--type=merge", "-p",
                              '{"spec":{"resources":{"gpus":2},"training":{"globalBatchSize":16}}}', check=False)
        assert out.returncode != 0 and "spec.suspend" in out.stderr, out.stderr
        st = job_status(testbed, ns, "frozen")
        meta = testbed.get("seqtrainjob", "frozen", ns)["metadata"]
        assert st["observedGeneration"] == meta["generation"]
        # A YAML float is not int-or-string: the apiserver refuses it, and so does `seqtrain validate`.
        floaty = yaml.safe_dump(gpu_job("floaty", gpus=1)).replace("cpu: '1'", "cpu: 0.5")
        assert "cpu: 0.5" in floaty
        refused = testbed.apply(floaty, ns, check=False)
        assert refused.returncode != 0 and "resources.cpu" in refused.stderr, refused.stderr
    finally:
        delete_job(testbed, ns, "frozen")


def crd_check(tb: Testbed) -> subprocess.CompletedProcess[str]:
    """`seqtrain crd --check` against the testbed (what a user runs before `helm upgrade`)."""
    return subprocess.run([str(ROOT / ".venv" / "bin" / "seqtrain"), "crd", "--check"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "KUBECONFIG": str(TB / "kubeconfig")})


def test_the_documented_crd_upgrade_path_upgrades_the_schema(testbed: Testbed, seqtrain_operator: Operator,
                                                             ns: str) -> None:
    """docs/user-guide.md "Upgrading the CRD": Helm never upgrades crds/, so an older CRD prunes new fields until
    `kubectl apply --server-side --force-conflicts -f charts/seqtrain/crds/seqtrainjob.yaml` before `helm upgrade`.
    (kubectl validates strictly and refuses the unknown field; clients that do not, e.g. the Python client, have it
    pruned silently.)"""
    current = ROOT / "charts" / "seqtrain" / "crds" / "seqtrainjob.yaml"
    old = yaml.safe_load(current.read_text())
    schema = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    del schema["properties"]["spec"]["properties"]["faultTolerance"]["properties"]["imagePullTimeoutSeconds"]
    job = gpu_job("crd-upgrade", gpus=1)
    job["spec"]["faultTolerance"] = {"imagePullTimeoutSeconds": 1234}
    try:
        testbed.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(old))
        check = crd_check(testbed)
        assert check.returncode == 1 and "lacks spec.faultTolerance.imagePullTimeoutSeconds" in check.stderr, check
        refused = testbed.apply(job, ns, check=False)
        assert refused.returncode != 0 and 'unknown field "spec.faultTolerance.imagePullTimeoutSeconds"' in \
            refused.stderr, refused.stderr
        pruned = testbed.kubectl("apply", "--validate=ignore", "-n", ns, "-f", "-", input=yaml.safe_dump(job))
        assert pruned.returncode == 0
        stored = testbed.get("seqtrainjob", "crd-upgrade", ns)["spec"].get("faultTolerance", {})
        assert "imagePullTimeoutSeconds" not in stored  # silently pruned by the older schema
        delete_job(testbed, ns, "crd-upgrade")
    finally:
        # The documented path, exactly.
        testbed.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(current))
        testbed.helm("upgrade", RELEASE, str(ROOT / "charts" / "seqtrain"), "--namespace", RELEASE_NS,
                     *seqtrain_operator.values(), "--wait", "--timeout", "180s", timeout=300)
    check = crd_check(testbed)
    assert check.returncode == 0 and "up to date" in check.stdout, check
    testbed.apply(job, ns)
    try:
        stored = testbed.get("seqtrainjob", "crd-upgrade", ns)["spec"]["faultTolerance"]
        assert stored["imagePullTimeoutSeconds"] == 1234
    finally:
        delete_job(testbed, ns, "crd-upgrade")


# ---- issue 24: a slow start is progress, not a stuck gang ---------------------------------------------------------


def test_replicas_placed_and_starting_are_progress_not_a_stuck_gang(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    """Both replicas are placed and stay ContainerCreating for 40 s (a large image being pulled, a volume being
    attached: the node agent holds them, as a kubelet reports it), far past pendingGraceSeconds (5). The gang is not
    torn down and re-planned (which would only pull again): the Starting condition says why it waits, and once the
    containers start the job trains to the end on its first attempt."""
    job = cpu_job("slow-start")
    job["spec"]["training"]["steps"] = 12
    job["spec"]["scheduling"]["pendingGraceSeconds"] = 5
    job["spec"]["podTemplate"] = {"metadata": {"annotations": {"testbed.seqtrain.dev/start-delay-seconds": "40"}}}
    testbed.apply(job, ns)
    try:
        def waiting() -> Any:  # the Starting condition, or the teardown that must not happen
            torn = [e["message"] for e in events(testbed, ns, "slow-start")
                    if e["reason"] in ("PendingTimeout", "StartTimeout")]
            return torn or ((c := condition(testbed, ns, "slow-start", "Starting")) and c["status"] == "True" and c)

        starting = wait("the gang waiting for its replicas to start", waiting, 120, 1)
        assert isinstance(starting, dict), f"torn down while its replicas were starting: {starting}"
        assert starting["reason"] == "ContainerCreating" and "startTimeoutSeconds" in starting["message"], starting
        done = wait_phase(testbed, seqtrain_operator, ns, "slow-start", "Succeeded")
        assert done["attempt"] == 1 and done.get("restarts", 0) == 0, done
        assert not [e for e in events(testbed, ns, "slow-start") if e["reason"] in ("PendingTimeout", "StartTimeout")]
        c = condition(testbed, ns, "slow-start", "Starting")
        assert c is not None and (c["status"], c["reason"]) == ("False", "Started"), c
    finally:
        delete_job(testbed, ns, "slow-start")
