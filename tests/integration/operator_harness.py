"""Runs the real kopf operator (our handlers) in a thread against the HTTP Kubernetes fake."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import Any

import kopf
from k8sfake import Cluster, FakeKubernetes, wait_for

from seqtrain.spec.crd import crd
from seqtrain.train.launch import free_port
from seqtrain_operator.k8s import handlers
from seqtrain_operator.k8s.manifests import Settings
from seqtrain_operator.k8s.reconcile import Config

JOBS = ("seqtrain.dev", "seqtrainjobs")


def fast_config(**settings: Any) -> Config:
    """Short polls so tests finish quickly; nothing else differs from production."""
    return Config(settings=Settings(progress_port=settings.pop("progress_port", None), **settings),
                  node_lost_grace=0.0, running_poll=0.3, idle_poll=1.0, progress_timeout=1.0)


class OperatorThread:
    """`kopf.operator()` in its own thread and event loop (what kopf.testing.KopfRunner does), stoppable."""

    def __init__(self, config: Config):
        self.config = config
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> OperatorThread:
        handlers.STATE.config = self.config
        # The admission webhook over plain HTTP on loopback (production serves TLS from the chart's certificate).
        self.webhook_port = free_port()
        handlers.enable_webhook(handlers.WebhookConfig(port=self.webhook_port, insecure=True))

        def run() -> None:
            try:
                asyncio.run(kopf.operator(standalone=True, clusterwide=True, stop_flag=self.stop_flag,
                                          ready_flag=self.ready_flag))
            except BaseException as exc:  # noqa: BLE001 - surfaced by stop()
                self.error = exc

        self.thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
        self.thread.start()
        if not self.ready_flag.wait(30):
            raise RuntimeError(f"operator did not become ready: {self.error}")
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        if self.thread is not None:
            self.thread.join(30)
            assert not self.thread.is_alive(), "operator did not stop within 30s"


@contextlib.contextmanager
def fake_cluster(tmp_path):
    os.environ.setdefault("SEQTRAIN_CHECK_PATHS", "0")
    with FakeKubernetes() as fake:
        cluster = Cluster(fake)
        cluster.install_crd(crd())
        old = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = fake.kubeconfig(str(tmp_path / "kubeconfig"))
        try:
            yield fake, cluster
        finally:
            if old is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = old


def job_doc(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"replicas": 2, "resources": {"gpus": 0, "cpu": "1", "memory": "1Gi"},
                            "training": {"steps": 10, "globalBatchSize": 2, "microBatchSize": 1},
                            "faultTolerance": {"backoffSeconds": 0, "maxRestarts": 2},
                            "scheduling": {"topology": {"policy": "none"}}}
    for k, v in spec.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": base}


def submit(cluster: Cluster, doc: dict[str, Any]) -> dict[str, Any]:
    return cluster.store.create(cluster.res(*JOBS), doc["metadata"]["namespace"], doc)


def job(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return cluster.get(*JOBS, namespace, name)


def status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return job(cluster, namespace, name).get("status") or {}


def wait_phase(cluster: Cluster, namespace: str, name: str, phase: str, timeout: float = 20.0) -> dict[str, Any]:
    return wait_for(lambda: (s := status(cluster, namespace, name)).get("phase") == phase and s,
                    timeout, what=f"{namespace}/{name} phase {phase}")


def pods_of(cluster: Cluster, namespace: str, name: str, attempt: int | None = None) -> list[dict[str, Any]]:
    sel = f"seqtrain.dev/job={name}" + (f",seqtrain.dev/attempt={attempt}" if attempt is not None else "")
    return cluster.pods(namespace, sel)


def wait_pods(cluster: Cluster, namespace: str, name: str, attempt: int, count: int, timeout: float = 20.0):
    return wait_for(lambda: len(p := pods_of(cluster, namespace, name, attempt)) == count and p, timeout,
                    what=f"{count} pods of {namespace}/{name} attempt {attempt}")


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions", []) if c["type"] == type_), {})


def events(cluster: Cluster, namespace: str) -> list[tuple[str, str]]:
    return [(e.get("reason"), e.get("message")) for e in cluster.list("", "events", namespace)]
