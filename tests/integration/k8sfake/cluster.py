"""Test-side controls of the fake: what nodes, the scheduler and the kubelet would do in a real cluster."""

from __future__ import annotations

from typing import Any

from .server import FakeKubernetes
from .store import Resource


class Cluster:
    """Convenience around a FakeKubernetes: nodes, pods' lifecycle, CRDs, typed lookups."""

    def __init__(self, fake: FakeKubernetes):
        self.fake = fake
        self.store = fake.store

    def res(self, group: str, plural: str) -> Resource:
        return self.store.resource(group, plural)

    # ---- reads -----------------------------------------------------------------------------------------------

    def pods(self, namespace: str = "default", selector: str = "") -> list[dict[str, Any]]:
        return self.store.list(self.res("", "pods"), namespace, selector)[0]

    def get(self, group: str, plural: str, namespace: str | None, name: str) -> dict[str, Any]:
        return self.store.get(self.res(group, plural), namespace, name)

    def list(self, group: str, plural: str, namespace: str | None = None, selector: str = "") -> list[dict]:
        return self.store.list(self.res(group, plural), namespace, selector)[0]

    # ---- nodes -----------------------------------------------------------------------------------------------

    def add_node(self, name: str, *, cpu: str = "8", memory: str = "32Gi", gpus: int = 0, ready: bool = True,
                 labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None) -> dict:
        alloc = {"cpu": cpu, "memory": memory, "pods": "110"}
        if gpus:
            alloc["nvidia.com/gpu"] = str(gpus)
        node = {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                "spec": {"taints": taints or []}}
        created = self.store.create(self.res("", "nodes"), None, node)
        return self.set_node_ready(created["metadata"]["name"], ready, alloc)

    def set_node_ready(self, name: str, ready: bool, allocatable: dict[str, str] | None = None) -> dict:
        status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                                  "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        if allocatable is not None:
            status["allocatable"] = allocatable
            status["capacity"] = allocatable
        return self.store.patch(self.res("", "nodes"), None, name, {"status": status},
                                "application/merge-patch+json", "status")

    # ---- the scheduler and kubelet's part --------------------------------------------------------------------

    def bind(self, namespace: str, name: str, node: str | None = None) -> dict:
        """Schedule a pod: onto `node`, or onto the node its required node affinity names."""
        pod = self.store.get(self.res("", "pods"), namespace, name)
        if node is None:
            terms = (pod["spec"].get("affinity", {}).get("nodeAffinity", {})
                     .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))
            node = terms[0]["matchFields"][0]["values"][0] if terms else "node-any"
        return self.store.patch(self.res("", "pods"), namespace, name, {"spec": {"nodeName": node}},
                                "application/merge-patch+json")

    def set_pod(self, namespace: str, name: str, phase: str, *, exit_code: int | None = None,
                reason: str | None = None, container_reason: str | None = None, message: str = "",
                pod_ip: str | None = None, conditions: list[dict] | None = None) -> dict:
        """What the kubelet reports: phase, the container's state (terminated with an exit code), reason."""
        if phase == "Running":
            state: dict[str, Any] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        elif phase in ("Succeeded", "Failed") and exit_code is not None:
            state = {"terminated": {"exitCode": exit_code, "reason": container_reason or
                                    ("Completed" if exit_code == 0 else "Error"), "message": message}}
        else:
            state = {"waiting": {"reason": container_reason or "ContainerCreating"}}
        status: dict[str, Any] = {"phase": phase, "containerStatuses": [
            {"name": "trainer", "state": state, "ready": phase == "Running", "restartCount": 0, "image": "x",
             "imageID": "", "started": phase == "Running"}]}
        if reason:
            status["reason"] = reason
        if message:
            status["message"] = message
        if pod_ip:
            status["podIP"] = pod_ip
        if conditions:
            status["conditions"] = conditions
        return self.store.patch(self.res("", "pods"), namespace, name, {"status": status},
                                "application/merge-patch+json", "status")

    def run_pods(self, namespace: str, selector: str) -> list[str]:
        """Bind every unbound pod matching the selector and start it (Running)."""
        started = []
        for pod in self.pods(namespace, selector):
            name = pod["metadata"]["name"]
            if not pod["spec"].get("nodeName"):
                self.bind(namespace, name)
            if pod["status"].get("phase") == "Pending":
                self.set_pod(namespace, name, "Running")
                started.append(name)
        return started

    def finish_pods(self, namespace: str, selector: str, exit_code: int = 0) -> None:
        for pod in self.pods(namespace, selector):
            self.set_pod(namespace, pod["metadata"]["name"], "Succeeded" if exit_code == 0 else "Failed",
                         exit_code=exit_code)

    # ---- CRDs --------------------------------------------------------------------------------------------------

    def install_crd(self, crd: dict[str, Any]) -> dict:
        return self.store.create(self.res("apiextensions.k8s.io", "customresourcedefinitions"), None, crd)

    def install_simple_crd(self, group: str, plural: str, kind: str, version: str = "v1",
                           namespaced: bool = True) -> dict:
        return self.install_crd({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Namespaced" if namespaced else "Cluster",
                     "names": {"plural": plural, "kind": kind, "singular": kind.lower()},
                     "versions": [{"name": version, "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": {"type": "object",
                                                                  "x-kubernetes-preserve-unknown-fields": True}},
                                   "subresources": {"status": {}}}]}})
