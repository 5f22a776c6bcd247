"""The operator under stress, on the real control plane: restarted mid-job, API conflicts / 500s / timeouts /
dropped watches / 410 Gone from the fault proxy in front of the apiserver, the webhook called by the apiserver.

Progress polled from rank 0 is tested where a real trainer serves it (test_testbed_e2e.py: pods of the node agent);
a kwok pod's IP is a simulated address that nothing here can serve, and pod IPs cannot be changed once set."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal

import pytest
from kubernetes.client.rest import ApiException
from operator_harness import (
    OperatorThread,
    add_node,
    condition,
    delete_job,
    events,
    fast_config,
    finish_pods,
    job,
    job_doc,
    jobs,
    module_env,
    namespace,
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

from testbed.fixtures import TB, rendezvous_port
from testbed.node_agent import AGENT_LABEL, IGNORE_DELETION

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def env(seqtrain_operator, tmp_path_factory):
    yield from module_env(seqtrain_operator, tmp_path_factory.mktemp("kube"), operator=False)


def _ns(env, name: str) -> str:
    b, pools = env
    ns = namespace(b.cp, name)
    pools.append(ns)
    add_node(b.cp, f"{ns}-0", pool=ns)
    return ns


def _passes(op: OperatorThread) -> float:
    """Reconcile passes this operator has made."""
    return sum(s.value for metric in op.runtime.metrics.reconcile_seconds.collect() for s in metric.samples
               if s.name.endswith("_count"))


def test_operator_restart_mid_job_loses_nothing_duplicates_nothing(env):
    b, _ = env
    cp, proxy = b.cp, b.proxy
    ns = _ns(env, "res-restart")
    op = OperatorThread(fast_config(), b.webhook()).start()
    try:
        submit(cp, job_doc("j", ns))
        wait_running(cp, ns, "j", 1, 2)
        wait_phase(cp, ns, "j", "Running")
        set_pod(cp, ns, "j-1-0", "Failed", exit_code=1)
        wait_pods(cp, ns, "j", 2, 2)
        before = status(cp, ns, "j")
    finally:
        op.stop()

    # while no operator runs, the new gang starts and a replica is OOM-killed
    wait_running(cp, ns, "j", 2, 2)
    set_pod(cp, ns, "j-2-1", "Failed", exit_code=137, container_reason="OOMKilled")
    op2 = OperatorThread(fast_config(), b.webhook()).start()
    try:
        wait_pods(cp, ns, "j", 3, 2)
        st = status(cp, ns, "j")
        assert st["restarts"] == before["restarts"] + 1 == 2  # counted once, from the persisted status
        assert st["attempt"] == 3
        wait_for(lambda: "OOMKilled" in reasons(cp, ns), what="OOMKilled event")
        wait_running(cp, ns, "j", 3, 2)
        wait_phase(cp, ns, "j", "Running")
        # a restart with nothing to do creates nothing
        op2.stop()
        op2 = OperatorThread(fast_config(), b.webhook()).start()
        wait_for(lambda: _passes(op2) > 0, what="reconciled again")  # (from the watch's body: no GET needed)
        finish_pods(cp, ns, "seqtrain.dev/attempt=3")
        wait_phase(cp, ns, "j", "Succeeded")
    finally:
        op2.stop()
    assert proxy.count("POST", rf"/namespaces/{ns}/pods$", status=201) == 6  # 3 attempts x 2, never more
    assert proxy.count("POST", rf"/namespaces/{ns}/pods$", status=409) == 0


def test_conflicts_500s_and_timeouts_are_retried_without_duplicates(env):
    b, _ = env
    cp, proxy = b.cp, b.proxy
    ns = _ns(env, "res-faults")
    pods_500 = proxy.add_rule("POST", rf"/namespaces/{ns}/pods$", status=500, times=3)
    conflicts = proxy.add_rule("PATCH", rf"/namespaces/{ns}/seqtrainjobs/j/status$", status=409, times=2)
    unavailable = proxy.add_rule("GET", rf"/namespaces/{ns}/seqtrainjobs/j$", status=503, times=2)
    # Native admission plans on every pod bound to a node, other tenants' included: those come from a paged LIST
    # (then a watch) of the pods without the job label that the operator sends at startup (k8s/capacity/foreign.py).
    # Hang that LIST for longer than the client waits: it is retried, and no gang is planned without it.
    hung = proxy.add_rule("GET", r"^/api/v1/pods$", watch=False, query=r"fieldSelector=", delay=20.0)
    op = OperatorThread(fast_config(), b.webhook()).start()
    try:
        submit(cp, job_doc("j", ns))
        pods = wait_pods(cp, ns, "j", 1, 2, timeout=60)
        assert sorted(p["metadata"]["name"] for p in pods) == ["j-1-0", "j-1-1"]
        wait_running(cp, ns, "j", 1, 2)
        st = wait_phase(cp, ns, "j", "Running")
        assert st["attempt"] == 1 and st["restarts"] == 0
        assert hung.hits == 1
    finally:
        op.stop()
    assert (pods_500.hits, conflicts.hits, unavailable.hits) == (3, 2, 2)
    assert proxy.count("POST", rf"/namespaces/{ns}/pods$", status=500) == 3
    assert proxy.count("POST", rf"/namespaces/{ns}/pods$", status=201) == 2  # retried, never doubled
    assert proxy.count("PATCH", rf"/namespaces/{ns}/seqtrainjobs/j/status$", status=409) == 2
    assert len(pods_of(cp, ns, "j")) == 2


def test_dropped_watches_and_410_gone_lose_no_pod_event(env):
    """kopf's pod and job watches are cut mid-stream and answered 410 Gone (resourceVersion too old): it must
    re-list and re-watch, and the operator must still see a pod failing and restart the gang."""
    b, _ = env
    cp, proxy = b.cp, b.proxy
    ns = _ns(env, "res-watch")
    op = OperatorThread(fast_config(), b.webhook()).start()
    try:
        submit(cp, job_doc("j", ns))
        wait_running(cp, ns, "j", 1, 2)
        wait_phase(cp, ns, "j", "Running")
        since = proxy.count("GET", r"^/api/v1/pods$", watch=True)
        # the next pod watches are cut at once, then answered 410 Gone, then let through; the job watch is
        # answered 410 Gone once
        dropped = proxy.add_rule("GET", r"^/api/v1/pods$", drop_after=0, times=2)
        gone = proxy.add_rule("GET", r"^/api/v1/pods$", gone=True, times=2)
        jobs_gone = proxy.add_rule("GET", r"^/apis/seqtrain.dev/v1alpha1/seqtrainjobs$", gone=True, times=1)
        # the open watches go, as when the apiserver restarts
        assert proxy.drop_watches(r"^/api/v1/pods$") >= 1
        assert proxy.drop_watches(r"^/apis/seqtrain.dev/v1alpha1/seqtrainjobs$") >= 1
        wait_for(lambda: dropped.hits == 2 and gone.hits == 2 and jobs_gone.hits == 1, 120,
                 what="watches dropped and expired")
        wait_for(lambda: proxy.count("GET", r"^/api/v1/pods$", watch=True) > since + 4, 60,
                 what="pod watch re-established")
        set_pod(cp, ns, "j-1-1", "Failed", exit_code=1)
        wait_pods(cp, ns, "j", 2, 2, timeout=60)
        st = status(cp, ns, "j")
        assert st["restarts"] == 1 and st["attempt"] == 2
    finally:
        op.stop()
    assert proxy.count("POST", rf"/namespaces/{ns}/pods$", status=201) == 4


def test_admission_webhook_refuses_what_spec_validation_refuses(env):
    """The apiserver calls the operator's webhook (the chart's ValidatingWebhookConfiguration, over TLS): a job that
    only the spec validation can refuse (a cross-field rule the CRD schema cannot express) is refused at apply time
    with the field named; a valid one is admitted."""
    b, _ = env
    cp = b.cp
    ns = _ns(env, "res-webhook")
    op = OperatorThread(fast_config(), b.webhook()).start()
    try:
        with pytest.raises(ApiException) as refused:
            submit(cp, job_doc("bad", ns, training={"globalBatchSize": 3, "microBatchSize": 1}))
        assert refused.value.status == 422, refused.value.body
        body = json.loads(refused.value.body)
        assert 'admission webhook "validate-seqtrainjob' in body["message"] or "denied the request" in body["message"]
        assert "spec.training.globalBatchSize: must be a multiple of microBatchSize" in body["message"]
        assert jobs(cp, ns) == []
        submit(cp, job_doc("good", ns))
        wait_pods(cp, ns, "good", 1, 2)
    finally:
        op.stop()


HOLD = "seqtrain.test/hold"  # a finalizer: keeps a deleted object Terminating until the test lets it go


def _hold(cp, ns: str, pod_names: list[str], configmaps: list[str]) -> None:
    for p in pod_names:
        cp.core.patch_namespaced_pod(p, ns, {"metadata": {"finalizers": [HOLD]}})
    for c in configmaps:
        cp.core.patch_namespaced_config_map(c, ns, {"metadata": {"finalizers": [HOLD]}})


def _release(cp, ns: str, pod_names: list[str], configmaps: list[str]) -> None:
    for p in pod_names:
        with contextlib.suppress(ApiException):
            cp.core.patch_namespaced_pod(p, ns, {"metadata": {"finalizers": None}})
    for c in configmaps:
        with contextlib.suppress(ApiException):
            cp.core.patch_namespaced_config_map(c, ns, {"metadata": {"finalizers": None}})


def test_a_reapplied_name_adopts_nothing_of_its_deleted_namesake(env):
    """A running job is deleted and the same name applied again at once, with another spec, while the old pods are
    still terminating (a kubelet in its grace period) and the old immutable ConfigMap still waits for the garbage
    collector (both held by a finalizer here). The new job takes neither: it waits for the old pods with the reason
    in its Scheduled condition, creates no pod while the old ConfigMap holds the name (a 409 from another job's
    object is no success), then runs its own gang from its own config, charged no restart."""
    b, _ = env
    cp, proxy = b.cp, b.proxy
    ns = _ns(env, "res-reuse")
    op = OperatorThread(fast_config(), b.webhook()).start()
    old_pods: list[str] = []
    try:
        submit(cp, job_doc("j", ns))
        old_pods = [p["metadata"]["name"] for p in wait_running(cp, ns, "j", 1, 2)]
        wait_phase(cp, ns, "j", "Running")
        old_uid = job(cp, ns, "j")["metadata"]["uid"]
        _hold(cp, ns, old_pods, ["j-config-1"])
        delete_job(cp, ns, "j")
        wait_for(lambda: not jobs(cp, ns), 60, what="the old job gone")
        new_uid = submit(cp, job_doc("j", ns, training={"steps": 7}))["metadata"]["uid"]
        assert new_uid != old_uid

        def waiting() -> bool:
            return "deleted SeqTrainJob of the same name" in condition(status(cp, ns, "j"), "Scheduled").get(
                "message", "")

        wait_for(waiting, 60, what="the new job waiting for the old pods")
        assert all(p["metadata"]["ownerReferences"][0]["uid"] == old_uid for p in pods_of(cp, ns, "j"))
        # the old pods end; the old ConfigMap still holds its name: the new job creates no pod meanwhile
        _release(cp, ns, old_pods, [])
        taken = proxy.count("POST", rf"/namespaces/{ns}/configmaps$", status=409)
        wait_for(lambda: proxy.count("POST", rf"/namespaces/{ns}/configmaps$", status=409) > taken, 60,
                 what="the new job's ConfigMap refused while the old one holds the name")
        assert all(p["metadata"]["ownerReferences"][0]["uid"] == old_uid for p in pods_of(cp, ns, "j"))
        _release(cp, ns, [], ["j-config-1"])
        new = wait_running(cp, ns, "j", 1, 2)
        assert {p["metadata"]["ownerReferences"][0]["uid"] for p in new} == {new_uid}
        assert {p["metadata"]["labels"]["seqtrain.dev/job-uid"] for p in new} == {new_uid}
        cm = cp.core.read_namespaced_config_map("j-config-1", ns)
        assert cm.metadata.owner_references[0].uid == new_uid
        assert json.loads(cm.data["config.json"])["job"]["spec"]["training"]["steps"] == 7
        st = wait_phase(cp, ns, "j", "Running")
        assert (st["restarts"], st.get("infraRestarts", 0), st["attempt"]) == (0, 0, 1)
        finish_pods(cp, ns, "seqtrain.dev/attempt=1")
        st = wait_phase(cp, ns, "j", "Succeeded")
        assert (st["restarts"], st.get("infraRestarts", 0)) == (0, 0)
    finally:
        _release(cp, ns, old_pods, ["j-config-1"])
        op.stop()


def test_objects_deleted_while_the_watches_are_cut_leave_no_ghost(env):
    """The pod and node watches are cut and cannot resume (410 Gone), and the LISTs that follow are held (an
    apiserver being replaced) while a pod of a running gang and an empty node are deleted: no DELETED event ever
    tells of them. The LIST that gets through replaces what the operator's caches held: the gang's lost pod is seen
    (the gang restarts) and the deleted node attracts no pins (a job that would fit only there waits Unschedulable
    and creates no pod)."""
    b, _ = env
    cp, proxy = b.cp, b.proxy
    ns = _ns(env, "res-ghost")
    op = OperatorThread(fast_config(), b.webhook()).start()
    try:
        submit(cp, job_doc("a", ns, resources={"cpu": "3"}))
        wait_running(cp, ns, "a", 1, 2)
        wait_phase(cp, ns, "a", "Running")
        add_node(cp, f"{ns}-1", pool=ns)  # empty: the only node job b below would fit on
        wait_for(lambda: any(n["metadata"]["name"] == f"{ns}-1" for n in op.runtime.node_list()), 60,
                 what="the operator sees the new node")
        watches = r"^/api/v1/(pods|nodes)$"
        proxy.add_rule("GET", watches, gone=True, times=None)  # a watch that tries to resume: 410, LIST again
        held = proxy.add_rule("GET", watches, watch=False, delay=20.0, times=None)
        assert proxy.drop_watches(watches) >= 2
        wait_for(lambda: held.hits >= 2, 60, what="the relists held")
        cp.core.delete_namespaced_pod("a-1-1", ns, grace_period_seconds=0)
        cp.core.delete_node(f"{ns}-1")
        wait_for(lambda: not [p for p in pods_of(cp, ns, "a", 1) if p["metadata"]["name"] == "a-1-1"], 30,
                 what="a-1-1 gone")
        wait_for(lambda: f"{ns}-1" not in [n.metadata.name for n in cp.core.list_node().items], 30,
                 what="the node gone")
        proxy.clear_rules()
        wait_pods(cp, ns, "a", 2, 2, timeout=120)  # the lost pod was seen: the gang restarted
        wait_phase(cp, ns, "a", "Running", timeout=180)
        submit(cp, job_doc("b", ns, replicas=1, resources={"cpu": "4"}))  # 2 of 8 CPUs are left on the live node
        wait_for(lambda: condition(status(cp, ns, "b"), "Scheduled").get("reason") == "Unschedulable", 60,
                 what="b waiting for capacity")
        assert pods_of(cp, ns, "b") == []
    finally:
        proxy.clear_rules()
        op.stop()


def test_a_read_write_once_checkpoint_claim_for_a_multi_node_gang_is_refused_at_admission(env):
    """The apiserver calls the webhook, which reads the claim: a ReadWriteOnce volume attaches to one node, so the
    other replicas of a 2-replica gang would wait in ContainerCreating for ever (Multi-Attach). Refused at apply time
    with the fix named; a ReadWriteMany claim, or one replica, is admitted."""
    b, _ = env
    cp = b.cp
    ns = _ns(env, "res-rwo")
    for name, mode in (("rwo", "ReadWriteOnce"), ("rwx", "ReadWriteMany")):
        cp.core.create_namespaced_persistent_volume_claim(ns, {
            "metadata": {"name": name}, "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}}})
    op = OperatorThread(fast_config(), b.webhook()).start()
    try:
        with pytest.raises(ApiException) as refused:
            submit(cp, job_doc("shared", ns, checkpoint={"pvc": "rwo"}))
        assert refused.value.status == 422, refused.value.body
        message = json.loads(refused.value.body)["message"]
        assert "spec.checkpoint.pvc: claim rwo is ReadWriteOnce" in message and "ReadWriteMany" in message, message
        assert jobs(cp, ns) == []
        submit(cp, job_doc("one", ns, replicas=1, checkpoint={"pvc": "rwo"}))
        submit(cp, job_doc("shared", ns, checkpoint={"pvc": "rwx"}))
        assert sorted(j["metadata"]["name"] for j in jobs(cp, ns)) == ["one", "shared"]
    finally:
        op.stop()


def test_an_eviction_is_a_disruption_and_a_budget_makes_it_wait(env):
    """A drain evicts a replica through the Eviction API (the apiserver marks the pod DisruptionTarget,
    EvictionByEvictionAPI): the gang restarts without spending maxInfraRestarts (0 here) and without putting the
    healthy node on the avoid list. With scheduling.podDisruptionBudget the eviction is refused (429) and the gang
    runs on; with scheduling.doNotDisrupt the pods carry the autoscalers' annotations."""
    b, _ = env
    cp = b.cp
    ns = _ns(env, "res-evict")
    op = OperatorThread(fast_config(), b.webhook()).start()
    try:
        submit(cp, job_doc("j", ns, faultTolerance={"maxInfraRestarts": 0}, scheduling={"doNotDisrupt": True}))
        pods = wait_running(cp, ns, "j", 1, 2)
        assert all(p["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true" for p in pods)
        wait_phase(cp, ns, "j", "Running")
        # the evicted pod is held Terminating, so the operator sees its last state (kwok would remove it at once)
        _hold(cp, ns, ["j-1-1"], [])
        cp.core.create_namespaced_pod_eviction("j-1-1", ns, {"metadata": {"name": "j-1-1", "namespace": ns}})
        st = wait_phase(cp, ns, "j", "Restarting", timeout=60)
        assert (st["restarts"], st.get("infraRestarts", 0), st.get("failedNodes") or {}) == (0, 0, {}), st
        assert "Evicted" in st["message"] and "not counted" in st["message"], st["message"]
        _release(cp, ns, ["j-1-1"], [])
        wait_running(cp, ns, "j", 2, 2)
        st = wait_phase(cp, ns, "j", "Running")
        assert (st["attempt"], st["restarts"], st.get("infraRestarts", 0)) == (2, 0, 0), st

        submit(cp, job_doc("k", ns, scheduling={"podDisruptionBudget": True}))
        wait_running(cp, ns, "k", 1, 2)
        wait_phase(cp, ns, "k", "Running")
        with pytest.raises(ApiException) as refused:
            cp.core.create_namespaced_pod_eviction("k-1-0", ns, {"metadata": {"name": "k-1-0", "namespace": ns}})
        assert refused.value.status == 429, refused.value.body
        assert "disruption budget" in refused.value.body
        assert status(cp, ns, "k")["attempt"] == 1
    finally:
        _release(cp, ns, ["j-1-1"], [])
        op.stop()


def test_a_429_retry_after_is_waited_out_and_the_job_still_runs(env):
    """The fault proxy answers the operator's first pod creations and a status write 429 Too Many Requests with
    Retry-After: 2 (an apiserver over its max-in-flight limit, or API Priority and Fairness). The operator's client
    (k8s/api/client.py, Kube._call) sends the same request again no sooner than that (its own backoff would retry in
    0.2 s), and the job still gets its pods and completes. The wait is read from the proxy's request log: the
    retry's arrival minus the refused request's arrival is a lower bound of what the client waited, so the check
    does not race the machine's speed. (kopf's own requests go through kopf's client, which honours Retry-After
    itself since kopf 1.43: handlers.KOPF_FLOOR.)"""
    b, _ = env
    cp, proxy = b.cp, b.proxy
    ns = _ns(env, "res-429")
    wait_s = 2.0
    pods_path, status_path = rf"/namespaces/{ns}/pods$", rf"/namespaces/{ns}/seqtrainjobs/j/status$"
    pods_429 = proxy.add_rule("POST", pods_path, status=429, times=2, retry_after=wait_s)
    status_429 = proxy.add_rule("PATCH", status_path, status=429, times=1, retry_after=wait_s)
    op = OperatorThread(fast_config(), b.webhook()).start()
    try:
        submit(cp, job_doc("j", ns))
        wait_running(cp, ns, "j", 1, 2)
        wait_phase(cp, ns, "j", "Running")
        finish_pods(cp, ns, "seqtrain.dev/attempt=1")
        st = wait_phase(cp, ns, "j", "Succeeded")
    finally:
        op.stop()
    assert (pods_429.hits, status_429.hits) == (2, 1)
    assert (st["restarts"], st["attempt"]) == (0, 1)
    posts = proxy.requests("POST", pods_path)
    refused = [r for r in posts if r.status == 429]
    assert len(refused) == 2
    for r in refused:
        name = r.body["metadata"]["name"]
        retry = next(x for x in posts if x.at > r.at and x.body["metadata"]["name"] == name)
        assert retry.at - r.at >= wait_s, (name, retry.at - r.at)
    assert proxy.count("POST", pods_path, status=201) == 2  # each pod created once, none doubled
    patches = proxy.requests("PATCH", status_path)
    (r,) = [x for x in patches if x.status == 429]
    retry = next(x for x in patches if x.at > r.at)
    assert retry.at - r.at >= wait_s, retry.at - r.at


def test_a_replica_stuck_terminating_on_a_ready_node_is_force_deleted_saying_so(env, testbed):
    """A wedged kubelet: replica 1 dies, the gang restarts, and the deletion of replica 0 (still running, on a Ready
    node) is never acted on nor confirmed (the node agent ignores it: testbed.seqtrain.dev/ignore-deletion). Once the
    pod is past its grace period by the operator's `termination_overdue`, the operator force-deletes it, with the
    Terminating condition and a ForceDeleted event, and the restarted gang runs to the end. Real trainer processes
    on the node agent's nodes; a 1 s grace and a 2 s overdue limit keep it short (production: 120 s and 60 s).
    (A pod that has ended is deleted at once by the apiserver whatever its kubelet does: only a running one can be
    stuck, hence the peer of the replica that died.)"""
    b, _ = env
    cp = b.cp
    ns = _ns(env, "res-stuck")
    cfg = dataclasses.replace(fast_config(termination_grace_seconds=1, master_port=rendezvous_port()),
                              termination_overdue=2.0)  # Settings are frozen
    # every rank of attempt 1 holds after step 1 (until SIGTERM, idle: no collective notices a peer's death)
    hold = [{"name": "SEQTRAIN_FAULT_HOLD_AT_STEP", "value": "1:600"}, {"name": "SEQTRAIN_FAULT_ATTEMPT", "value": "1"}]
    doc = job_doc("j", ns, resources={"cpu": "500m"}, model={"arch": "gpt", "preset": "tiny"},
                  data={"source": "builtin", "seqLen": 32}, training={"steps": 4, "globalBatchSize": 2},
                  scheduling={"nodeSelector": {AGENT_LABEL: "true"}}, faultTolerance={"inPlaceRestarts": 0},
                  podTemplate={"spec": {"containers": [{"name": "trainer", "env": hold}]}})
    op = OperatorThread(cfg, b.webhook()).start()
    try:
        submit(cp, doc)
        stuck, dying = wait_running(cp, ns, "j", 1, 2)
        cp.core.patch_namespaced_pod(stuck["metadata"]["name"], ns,
                                     {"metadata": {"annotations": {IGNORE_DELETION: "true"}}})

        def holding(pod: dict) -> bool:
            log = TB / "agent" / "pods" / pod["metadata"]["uid"] / "container.log"
            return log.exists() and "holding after step 1" in log.read_text(errors="replace")

        wait_for(lambda: holding(stuck) and holding(dying), 180, what="both ranks holding after step 1")
        os.killpg(testbed.pod_pid(dying["metadata"]["uid"]), signal.SIGKILL)  # the gang restarts

        def force_deleted() -> list[str]:
            return [msg for reason, msg in events(cp, ns) if reason == "ForceDeleted"]

        (told,) = wait_for(force_deleted, 120, what="the ForceDeleted event")
        assert "replica(s) 0 still terminating" in told and stuck["spec"]["nodeName"] in told, told
        wait_for(lambda: not pods_of(cp, ns, "j", 1), 60, what="j-1-0 force-deleted")
        wait_running(cp, ns, "j", 2, 2)
        st = wait_phase(cp, ns, "j", "Succeeded", timeout=300)
        assert st["attempt"] == 2, st
        # said True (TerminationOverdue, with the event's message) while it was stuck; False once it was gone
        c = condition(st, "Terminating")
        assert (c["status"], c["reason"]) == ("False", "Gone"), c
    finally:
        op.stop()
