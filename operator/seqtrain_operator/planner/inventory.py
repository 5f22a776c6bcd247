"""Cluster inventory (pure): Kubernetes Node and Pod objects (plain dicts) -> free capacity per node.

Free = allocatable - the requests of every non-terminated pod bound to the node, the same arithmetic the
kube-scheduler's NodeResourcesFit plugin does. GPUs are the extended resource `nvidia.com/gpu`; GPU feature
discovery labels (`nvidia.com/gpu.product`, `nvidia.com/gpu.memory`, ...) stay in `Node.labels`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from .types import Node

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"

_SUFFIX = {
    "": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_QTY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "8Gi", 2, "1e3") as an exact Decimal; ValueError names the bad text."""
    text = str(value).strip()
    m = _QTY.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 2, 500m, 8Gi)")
    try:
        return Decimal(m.group(1)) * Decimal(_SUFFIX[m.group(2) or ""])
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 2, 500m, 8Gi)") from None


def cpu_millis(value: Any) -> int:
    # The scheduler rounds CPU up to whole millicores.
    return int((parse_quantity(value) * 1000).to_integral_value(rounding="ROUND_CEILING"))


def memory_bytes(value: Any) -> int:
    return int(parse_quantity(value).to_integral_value(rounding="ROUND_CEILING"))


@dataclass(frozen=True)
class Requests:
    gpus: int = 0
    cpu_millis: int = 0
    memory_bytes: int = 0

    def __add__(self, other: Requests) -> Requests:
        return Requests(self.gpus + other.gpus, self.cpu_millis + other.cpu_millis,
                        self.memory_bytes + other.memory_bytes)

    def max(self, other: Requests) -> Requests:
        return Requests(max(self.gpus, other.gpus), max(self.cpu_millis, other.cpu_millis),
                        max(self.memory_bytes, other.memory_bytes))


def _container_requests(c: Mapping[str, Any]) -> Requests:
    res = c.get("resources") or {}
    # A resource with only a limit is requested at the limit (the API server defaults it that way).
    merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    return Requests(
        gpus=int(parse_quantity(merged.get(GPU_RESOURCE, 0))),
        cpu_millis=cpu_millis(merged.get("cpu", 0)),
        memory_bytes=memory_bytes(merged.get("memory", 0)),
    )


def pod_requests(pod: Mapping[str, Any]) -> Requests:
    """Effective requests of a pod: max(sum of containers, largest init container) + overhead."""
    spec = pod.get("spec") or {}
    total = Requests()
    for c in spec.get("containers") or []:
        total = total + _container_requests(c)
    for c in spec.get("initContainers") or []:
        total = total.max(_container_requests(c))
    overhead = spec.get("overhead") or {}
    if overhead:
        total = total + _container_requests({"resources": {"requests": overhead}})
    return total


def occupies_node(pod: Mapping[str, Any]) -> bool:
    """Bound and not terminated: its requests still count against the node."""
    node = (pod.get("spec") or {}).get("nodeName")
    phase = (pod.get("status") or {}).get("phase")
    return bool(node) and phase not in ("Succeeded", "Failed")


def used_by_node(pods: Iterable[Mapping[str, Any]]) -> dict[str, Requests]:
    used: dict[str, Requests] = {}
    for pod in pods:
        if occupies_node(pod):
            node = pod["spec"]["nodeName"]
            used[node] = used.get(node, Requests()) + pod_requests(pod)
    return used


def _ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def node_from_k8s(node: Mapping[str, Any], used: Requests = Requests()) -> Node:
    """One Kubernetes Node object -> the planner's Node with FREE capacity (never negative)."""
    status = node.get("status") or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    spec = node.get("spec") or {}
    taints = tuple(
        (str(t.get("key", "")), str(t.get("value", "") or ""), str(t.get("effect", "")))
        for t in spec.get("taints") or []
    )
    return Node(
        name=node["metadata"]["name"],
        gpus=max(0, int(parse_quantity(alloc.get(GPU_RESOURCE, 0))) - used.gpus),
        cpu_millis=max(0, cpu_millis(alloc.get("cpu", 0)) - used.cpu_millis),
        memory_bytes=max(0, memory_bytes(alloc.get("memory", 0)) - used.memory_bytes),
        labels=dict((node.get("metadata") or {}).get("labels") or {}),
        schedulable=not spec.get("unschedulable", False),
        ready=_ready(node),
        taints=taints,
    )


def inventory(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> list[Node]:
    """Every node with its free capacity after the requests of the pods already bound to it."""
    used = used_by_node(pods)
    out = [node_from_k8s(n, used.get(n["metadata"]["name"], Requests())) for n in nodes]
    return sorted(out, key=lambda n: n.name)
