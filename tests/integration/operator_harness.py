"""The real kopf operator (our handlers) against the real control plane of `scripts/testbed.sh`, through the
fault proxy (tests/testbed/faultproxy.py).

The chart is installed by the testbed's `seqtrain_operator` fixture (a real `helm install`, the webhook pointed at
127.0.0.1 over TLS); a module here stops that fixture's operator process and runs its own operators instead,
authenticated with a TokenRequest token of the chart's ServiceAccount (exactly the chart's RBAC), with a kubeconfig
that points at a `FaultProxy` in front of the apiserver: it records every request and injects the faults a test
asks for. These operators serve the chart's webhook (same port, same certificate), so every job a test creates
passes the real admission chain. At the end of the module the fixture's operator is started again.

The test itself is the cluster admin and plays the kubelet of kwok's simulated nodes where it needs a pod to end a
particular way: it writes the pod's status the way a kubelet does (`pods/status`); kwok, which runs every pod bound
to its nodes, leaves a terminated pod alone and confirms deletions. Each test works in its own namespace and on its
own kwok nodes (a label only its jobs select), so it neither sees nor disturbs the testbed's other nodes and jobs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from jobs import make_job
from seqtrain_operator.k8s.pods.manifests import Settings
from seqtrain_operator.k8s.process import handlers
from seqtrain_operator.k8s.process.runtime import Runtime
from seqtrain_operator.k8s.settings import Settings as OperatorSettings
from seqtrain_operator.k8s.settings import WebhookConfig
from testbed.faultproxy import FaultProxy
from testbed.fixtures import TB, Operator

__all__ = ["FaultProxy"]
GROUP, VERSION, PLURAL = "seqtrain.dev", "v1alpha1", "seqtrainjobs"
POOL_LABEL = "seqtrain.test/pool"
T = TypeVar("T")


def wait_for(fn: Callable[[], T], timeout: float = 120.0, what: str = "condition", interval: float = 0.2) -> T:
    """Poll `fn` until it returns something truthy (returned); fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


# ---- the control plane ----------------------------------------------------------------------------------------


@dataclass
class ControlPlane:
    kubeconfig: str  # the admin's
    server: str
    ca_file: str
    api: client.ApiClient

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)


@dataclass
class Bed:
    """What one test module works with: the control plane (as admin), the proxy the operator goes through, the
    ServiceAccount's token, the operator's kubeconfig, and the chart's webhook (port, certificate folder)."""

    cp: ControlPlane
    proxy: FaultProxy
    token: str
    kubeconfig: str
    webhook_port: int
    webhook_certs: Path

    def webhook(self) -> WebhookConfig:
        return WebhookConfig(port=self.webhook_port, certfile=str(self.webhook_certs / "tls.crt"),
                                      keyfile=str(self.webhook_certs / "tls.key"))


def bed(fixture_operator: Operator, tmp: Path) -> Iterator[Bed]:
    """Generator for a module fixture (see the module's docstring)."""
    # The operator in this process skips data-path checks (paths exist in the pods); restored after the module so
    # later tests in the same pytest process validate paths again.
    old_check = os.environ.get("SEQTRAIN_CHECK_PATHS")
    os.environ["SEQTRAIN_CHECK_PATHS"] = "0"
    tb = fixture_operator.tb
    cp = ControlPlane(str(tb.kubeconfig), tb.server(), str(TB / "pki" / "ca.crt"),
                      config.new_client_from_config(config_file=str(tb.kubeconfig)))
    token = fixture_operator.token()
    fixture_operator.stop()
    proxy = FaultProxy(upstream=cp.server, ca_file=cp.ca_file).start()
    kc = proxy.kubeconfig(str(tmp / "operator.kubeconfig"), token=token)
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = kc
    try:
        yield Bed(cp, proxy, token, kc, fixture_operator.webhook_port, TB / "webhook-certs")
    finally:
        proxy.stop()
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        if old_check is None:
            os.environ.pop("SEQTRAIN_CHECK_PATHS", None)
        else:
            os.environ["SEQTRAIN_CHECK_PATHS"] = old_check
        fixture_operator.start()


def module_env(fixture_operator: Operator, tmp: Path, *, operator: bool) -> Iterator[tuple[Bed, list[str]]]:
    """Generator for a module's `env` fixture: the bed and the namespaces its tests make (deleted at the end).
    `operator`: one in-process operator serves the whole module; else each test starts its own, and one runs only
    for the teardown (the jobs' finalizers need an operator to be released)."""
    gen = bed(fixture_operator, tmp)
    b = next(gen)
    op = OperatorThread(fast_config(), b.webhook()).start() if operator else None
    pools: list[str] = []
    try:
        yield b, pools
    finally:
        try:
            if op is None:
                op = OperatorThread(fast_config(), b.webhook()).start()
            b.proxy.clear_rules()
            teardown(b.cp, pools)
        finally:
            op.stop()
            gen.close()


# ---- the operator -------------------------------------------------------------------------------------------


def fast_config(**settings: Any) -> OperatorSettings:
    """Short polls so tests finish quickly; nothing else differs from production (whose node-lost grace is 40 s: a
    node NotReady for a moment, as a late heartbeat on a busy machine makes it, is not a lost node)."""
    grace = settings.pop("node_lost_grace", 5.0)
    return OperatorSettings(pods=Settings(progress_port=settings.pop("progress_port", None), **settings),
                            node_lost_grace=grace, running_poll=0.3, idle_poll=1.0, progress_timeout=1.0,
                            progress_interval=1.0)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class OperatorThread:
    """`kopf.operator()` in its own thread and event loop (what kopf.testing.KopfRunner does), stoppable."""

    def __init__(self, config: OperatorSettings, webhook: WebhookConfig | None = None,
                 namespaces: tuple[str, ...] = ()):
        self.config = config
        self.runtime = Runtime(dataclasses.replace(config, webhook=webhook))  # what the operator holds
        self.namespaces = namespaces
        self.webhook = webhook
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> OperatorThread:
        if self.webhook is not None:
            handlers.enable_webhook()

        def run() -> None:
            try:
                asyncio.run(kopf.operator(standalone=True, clusterwide=not self.namespaces,
                                          namespaces=self.namespaces, stop_flag=self.stop_flag,
                                          ready_flag=self.ready_flag, memo=handlers.memo_of(self.runtime)))
            except BaseException as exc:  # noqa: BLE001 - surfaced by stop()
                self.error = exc

        self.thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
        self.thread.start()
        if not self.ready_flag.wait(60):
            raise RuntimeError(f"operator did not become ready: {self.error}")
        if self.webhook is not None:
            wait_for(lambda: self.error is None and _listening(self.webhook.port), 60,
                     what=f"the operator's webhook on port {self.webhook.port} (error: {self.error})")
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        if self.thread is not None:
            self.thread.join(30)
            assert not self.thread.is_alive(), "operator did not stop within 30s"


# ---- objects (as the admin) -----------------------------------------------------------------------------------


def namespace(cp: ControlPlane, prefix: str) -> str:
    """A fresh namespace for one test (a random suffix: an interrupted run's leftovers never collide)."""
    name = f"{prefix}-{uuid.uuid4().hex[:5]}"
    cp.core.create_namespace({"metadata": {"name": name}})
    # the ServiceAccount the pods run as must exist before the operator creates pods
    wait_for(lambda: not _absent(lambda: cp.core.read_namespaced_service_account("default", name)), 30,
             what=f"default ServiceAccount in {name}")
    return name


def teardown(cp: ControlPlane, namespaces: list[str], wait: bool = True) -> None:
    """Delete the tests' jobs while their operator still runs (it releases the finalizers), then the namespaces
    and the nodes of their pools. wait=False: leave the finalizers to the next operator (the testbed fixture's)."""
    for ns in namespaces:
        for j in jobs(cp, ns):
            with _suppress_404():
                delete_job(cp, ns, j["metadata"]["name"])
    for ns in namespaces:
        if wait:
            wait_for(lambda ns=ns: not jobs(cp, ns), 60, what=f"jobs of {ns} deleted")
        with _suppress_404():
            cp.core.delete_namespace(ns)
        delete_nodes(cp, ns)


class _suppress_404:
    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> bool:
        return isinstance(exc, ApiException) and exc.status == 404


def _absent(read: Callable[[], Any]) -> bool:
    try:
        read()
        return False
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise


def add_node(cp: ControlPlane, name: str, *, pool: str, cpu: str = "8", memory: str = "32Gi", gpus: int = 0,
             labels: dict[str, str] | None = None, extended: dict[str, str] | None = None) -> None:
    """A kwok node (kwok keeps it Ready and runs the pods bound to it) in `pool`."""
    capacity = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi", **(extended or {})}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                         "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "type": "kwok",
                                    POOL_LABEL: pool, **(labels or {})}},
            "spec": {},
            "status": {"capacity": capacity, "allocatable": capacity}}
    with_retry_absent(cp, name)
    cp.core.create_node(node)
    wait_for(lambda: _node_ready(cp, name), 60, what=f"kwok node {name} Ready")


def with_retry_absent(cp: ControlPlane, name: str) -> None:
    """Delete a leftover node of that name (an earlier, interrupted run)."""
    try:
        cp.core.delete_node(name)
        wait_for(lambda: _absent(lambda: cp.core.read_node(name)), 30, what=f"old node {name} gone")
    except ApiException as exc:
        if exc.status != 404:
            raise


def _node_ready(cp: ControlPlane, name: str) -> bool:
    """Ready, and the node lifecycle controller has lifted the taints it puts on a new node until it sees it Ready
    (`node.kubernetes.io/not-ready:NoSchedule`): until then kube-scheduler, and the operator's planner, leave the
    node out, and a test that placed a gang right after a node's Ready condition found it missing (spread put both
    replicas on the other node)."""
    node = cp.core.read_node(name)
    ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
    condition_taints = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
    return ready and not any(t.key in condition_taints for t in (node.spec.taints or []))


def delete_nodes(cp: ControlPlane, pool: str) -> None:
    cp.core.delete_collection_node(label_selector=f"{POOL_LABEL}={pool}")


def job_doc(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"replicas": 2, "resources": {"gpus": 0, "cpu": "1", "memory": "1Gi"},
                            "training": {"steps": 10, "globalBatchSize": 2, "microBatchSize": 1},
                            "faultTolerance": {"backoffSeconds": 0, "maxRestarts": 2},
                            "scheduling": {"topology": {"policy": "none"}, "nodeSelector": {POOL_LABEL: namespace}}}
    for k, v in spec.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return make_job(name, namespace, **base)


def submit(cp: ControlPlane, doc: dict[str, Any]) -> dict[str, Any]:
    return cp.custom.create_namespaced_custom_object(GROUP, VERSION, doc["metadata"]["namespace"], PLURAL, doc)


def patch_job(cp: ControlPlane, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    return cp.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, patch)


def delete_job(cp: ControlPlane, ns: str, name: str) -> None:
    cp.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


def job(cp: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return cp.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


def jobs(cp: ControlPlane, ns: str) -> list[dict[str, Any]]:
    return cp.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]


def status(cp: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return job(cp, ns, name).get("status") or {}


def wait_phase(cp: ControlPlane, ns: str, name: str, phase: str, timeout: float = 120.0) -> dict[str, Any]:
    try:
        return wait_for(lambda: (s := status(cp, ns, name)).get("phase") == phase and s, timeout,
                        what=f"{ns}/{name} phase {phase}")
    except AssertionError as exc:  # say what the job and its pods were doing instead
        pods_now = [(p["metadata"]["name"], p["status"].get("phase"), bool(p["metadata"].get("deletionTimestamp")),
                     p["spec"].get("nodeName")) for p in pods_of(cp, ns, name)]
        told = [(e.reason, e.message) for e in cp.core.list_namespaced_event(ns).items
                if e.involved_object.name == name]
        raise AssertionError(f"{exc}\nstatus: {status(cp, ns, name)}\npods (name, phase, terminating, node): "
                             f"{pods_now}\nevents: {told}") from None


def pods_of(cp: ControlPlane, ns: str, name: str, attempt: int | None = None) -> list[dict[str, Any]]:
    sel = f"seqtrain.dev/job={name}" + (f",seqtrain.dev/attempt={attempt}" if attempt is not None else "")
    return pods(cp, ns, sel)


def pods(cp: ControlPlane, ns: str, selector: str = "") -> list[dict[str, Any]]:
    items = cp.api.sanitize_for_serialization(cp.core.list_namespaced_pod(ns, label_selector=selector).items)
    return sorted(items, key=lambda p: p["metadata"]["name"])


def wait_pods(cp: ControlPlane, ns: str, name: str, attempt: int, count: int, timeout: float = 120.0,
              phase: str | None = None) -> list[dict[str, Any]]:
    """`count` pods of the attempt, none of them terminating (and all in `phase`, when given)."""
    def ready() -> list[dict[str, Any]] | None:
        p = [x for x in pods_of(cp, ns, name, attempt) if not x["metadata"].get("deletionTimestamp")]
        ok = len(p) == count and (phase is None or all(x["status"].get("phase") == phase for x in p))
        return p if ok else None

    return wait_for(ready, timeout, what=f"{count} pods of {ns}/{name} attempt {attempt}"
                    + (f" {phase}" if phase else ""))


def wait_running(cp: ControlPlane, ns: str, name: str, attempt: int, count: int, timeout: float = 180.0
                 ) -> list[dict[str, Any]]:
    """kube-scheduler binds the gang's pods and kwok runs them."""
    return wait_pods(cp, ns, name, attempt, count, timeout, phase="Running")


def pinned_node(pod: dict[str, Any]) -> str:
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return terms["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]


def set_pod(cp: ControlPlane, ns: str, name: str, phase: str, *, exit_code: int | None = None,
            reason: str | None = None, container_reason: str | None = None, message: str = "",
            conditions: list[dict[str, Any]] | None = None) -> None:
    """Play the kubelet: report the pod ended (`pods/status`), as a kubelet does when its container exits."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state: dict[str, Any] = {"terminated": {"exitCode": exit_code if exit_code is not None else 0,
                                            "reason": container_reason or ("Completed" if not exit_code else "Error"),
                                            "message": message, "startedAt": now, "finishedAt": now}}
    pod = cp.core.read_namespaced_pod(name, ns)
    image = pod.spec.containers[0].image
    st: dict[str, Any] = {"phase": phase, "containerStatuses": [
        {"name": "trainer", "state": state, "ready": False, "restartCount": 0, "image": image, "imageID": "",
         "started": False}]}
    if reason:
        st["reason"] = reason
    if message and reason:
        st["message"] = message
    if conditions:
        st["conditions"] = conditions
    cp.core.patch_namespaced_pod_status(name, ns, {"status": st})


def finish_pods(cp: ControlPlane, ns: str, selector: str, exit_code: int = 0) -> None:
    for pod in pods(cp, ns, selector):
        set_pod(cp, ns, pod["metadata"]["name"], "Succeeded" if exit_code == 0 else "Failed", exit_code=exit_code)


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions", []) if c["type"] == type_), {})


def events(cp: ControlPlane, ns: str) -> list[tuple[str, str]]:
    return [(e.reason, e.message) for e in cp.core.list_namespaced_event(ns).items]


def reasons(cp: ControlPlane, ns: str) -> set[str]:
    return {r for r, _ in events(cp, ns)}
