"""The capacity ledger: what every non-terminated pod bound or pinned to a node takes of it, kept per node and
updated one pod event at a time (ours from their mirror, other tenants' from k8s/capacity/foreign.py's;
k8s/cache/mirror.py).

Why: admission used to re-read every pod of the cluster per gang (a LIST of other tenants' pods, then an inventory
of all 8000 pods: about 8M pod visits in the 1000-job run). Now a pod event costs one subtraction and one addition,
and an admission costs one pass over the nodes: free = allocatable - used (the same arithmetic as
planner/inventory.py, which the tests compare it with) - the reservations of gangs decided but not yet seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.planner.inventory import Requests, node_from_k8s, node_of, pod_requests
from seqtrain_operator.planner.types import Node

Key = tuple[str, str]  # (namespace, pod name)


def _neg(r: Requests) -> Requests:
    return Requests(-r.gpus, -r.cpu_millis, -r.memory_bytes, -r.pods, tuple((k, -v) for k, v in r.other))


@dataclass
class _Held:
    node: str | None  # None: the pod takes no node's capacity (terminated, or not bound nor pinned yet)
    requests: Requests
    job: Key | None  # (namespace, job) for the operator's pods


@dataclass
class Ledger:
    pods: dict[Key, _Held] = field(default_factory=dict)  # every pod seen and not deleted
    used: dict[str, Requests] = field(default_factory=dict)  # node -> the requests of the pods on it
    by_job: dict[Key, set[Key]] = field(default_factory=dict)  # (namespace, job) -> its pods

    def update(self, pod: Mapping[str, Any]) -> None:
        """A pod as a watch delivered it (added or modified)."""
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        job_label = (meta.get("labels") or {}).get(m.LABEL_JOB)
        node = node_of(pod)
        held = _Held(node, pod_requests(pod) if node is not None else Requests(),
                     (key[0], job_label) if job_label else None)
        self.remove(key)
        self.pods[key] = held
        if node is not None:
            self.used[node] = self.used.get(node, Requests()) + held.requests
        if held.job is not None:
            self.by_job.setdefault(held.job, set()).add(key)

    def remove(self, key: Key) -> None:
        """The pod is deleted (or left the watch's selection)."""
        held = self.pods.pop(key, None)
        if held is None:
            return
        if held.node is not None:
            self.used[held.node] = self.used[held.node] + _neg(held.requests)
        if held.job is not None and (keys := self.by_job.get(held.job)) is not None:
            keys.discard(key)
            if not keys:
                del self.by_job[held.job]

    def replace(self, pods: Iterable[Mapping[str, Any]], where: Any) -> None:
        """A re-LIST of one source: its pods now are `pods`; those of it (`where(held)`) not among them are gone."""
        fresh = {((p.get("metadata") or {}).get("namespace") or "", (p.get("metadata") or {}).get("name") or ""): p
                 for p in pods}
        for key in [k for k, h in self.pods.items() if where(h) and k not in fresh]:
            self.remove(key)
        for pod in fresh.values():
            self.update(pod)

    def used_by(self, job: Key) -> list[tuple[str, Requests]]:
        """What the pods of `job` (namespace, job) take, per node."""
        return [(held.node, held.requests) for key in self.by_job.get(job, ())
                if (held := self.pods[key]).node is not None]

    def seen(self, key: Key) -> bool:
        return key in self.pods

    def free(self, nodes: Iterable[Mapping[str, Any]], reserved: Iterable[Mapping[str, Any]] = (),
             exclude_job: Key | None = None, reserved_use: Iterable[tuple[str, Requests]] = ()) -> list[Node]:
        """Every node with its free capacity, less the pods in `reserved` (decided, not seen yet; or already as
        (node, requests) in `reserved_use`). The pods of `exclude_job` do not count: a job being admitted has no
        live pods, so any still shown are going."""
        used = dict(self.used)
        for key in self.by_job.get(exclude_job, ()) if exclude_job is not None else ():
            held = self.pods[key]
            if held.node is not None:
                used[held.node] = used[held.node] + _neg(held.requests)
        for pod in reserved:
            if (node := node_of(pod)) is not None:
                used[node] = used.get(node, Requests()) + pod_requests(pod)
        for node, requests in reserved_use:
            used[node] = used.get(node, Requests()) + requests
        out = [node_from_k8s(n, used.get(n["metadata"]["name"], Requests())) for n in nodes]
        return sorted(out, key=lambda n: n.name)
