"""Cluster inventory (pure): Kubernetes Node and Pod objects (plain dicts) -> free capacity per node.

Free = allocatable - the requests of every non-terminated pod on the node, the same arithmetic the
kube-scheduler's NodeResourcesFit plugin does, for every resource it checks: CPU, memory, the pod count
(`pods`), ephemeral storage and every extended resource. GPUs are the extended resource `nvidia.com/gpu`; GPU
feature discovery labels (`nvidia.com/gpu.product`, `nvidia.com/gpu.memory`, ...) stay in `Node.labels`.

"On the node" includes pods created but not bound yet that are headed there (pinned by a required node affinity
on metadata.name, as the operator's native placement pins them, or nominated by the scheduler): otherwise two
jobs planned a moment apart would both claim the same free GPUs before either's pods are bound.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Any

from seqtrain_operator.planner.types import Node

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


_CORE = ("cpu", "memory", "pods", GPU_RESOURCE)
Other = tuple[tuple[str, int], ...]  # sorted (resource, amount) pairs: ephemeral-storage bytes, extended resources


def _merge(a: Other, b: Other, op: Any) -> Other:
    da, db = dict(a), dict(b)
    return tuple(sorted((k, op(da.get(k, 0), db.get(k, 0))) for k in da.keys() | db.keys()))


@dataclass(frozen=True)
class Requests:
    gpus: int = 0
    cpu_millis: int = 0
    memory_bytes: int = 0
    pods: int = 0
    other: Other = ()

    def __add__(self, other: Requests) -> Requests:
        return Requests(self.gpus + other.gpus, self.cpu_millis + other.cpu_millis,
                        self.memory_bytes + other.memory_bytes, self.pods + other.pods,
                        _merge(self.other, other.other, lambda x, y: x + y))

    def max(self, other: Requests) -> Requests:
        return Requests(max(self.gpus, other.gpus), max(self.cpu_millis, other.cpu_millis),
                        max(self.memory_bytes, other.memory_bytes), max(self.pods, other.pods),
                        _merge(self.other, other.other, max))


def amount(resource: str, value: Any) -> int:
    """A quantity of `resource` in the unit the planner counts: millicores for cpu, else whole units (bytes)."""
    return cpu_millis(value) if resource == "cpu" else memory_bytes(value)


def _resource_requests(merged: Mapping[str, Any]) -> Requests:
    return Requests(
        gpus=int(parse_quantity(merged.get(GPU_RESOURCE, 0))),
        cpu_millis=cpu_millis(merged.get("cpu", 0)),
        memory_bytes=memory_bytes(merged.get("memory", 0)),
        other=tuple(sorted((k, amount(k, v)) for k, v in merged.items() if k not in _CORE)),
    )


def _container_requests(c: Mapping[str, Any]) -> Requests:
    res = c.get("resources") or {}
    # A resource with only a limit is requested at the limit (the API server defaults it that way).
    return _resource_requests({**(res.get("limits") or {}), **(res.get("requests") or {})})


# Parsed quantities by object version: admission runs the inventory over every pod and node of the cluster (8000
# pods on 500 nodes at scale), and between two admissions almost none of them changed. Bounded: cleared when full.
_MEMO: dict[tuple[str, str, str], Any] = {}
_MEMO_MAX = 100_000


def _memo(kind: str, obj: Mapping[str, Any], compute: Any) -> Any:
    meta = obj.get("metadata") or {}
    rv = meta.get("resourceVersion")
    if not rv:  # not from the API server (a test's literal): nothing to key it by
        return compute(obj)
    key = (kind, str(meta.get("uid") or meta.get("name")), str(rv))
    hit = _MEMO.get(key)
    if hit is None:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        hit = _MEMO[key] = compute(obj)
    return hit


def pod_requests(pod: Mapping[str, Any]) -> Requests:
    """Effective requests of a pod, as kube-scheduler counts them: max(sum of containers and native sidecars, each
    init container plus the sidecars started before it) + overhead, and one pod."""
    return _memo("pod", pod, _pod_requests)  # type: ignore[no-any-return]


def _pod_requests(pod: Mapping[str, Any]) -> Requests:
    spec = pod.get("spec") or {}
    total = Requests()
    for c in spec.get("containers") or []:
        total = total + _container_requests(c)
    sidecars, init = Requests(), Requests()
    for c in spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":  # a native sidecar: runs beside everything after it
            sidecars = sidecars + _container_requests(c)
            init = init.max(sidecars)
        else:
            init = init.max(sidecars + _container_requests(c))
    total = (total + sidecars).max(init)
    overhead = spec.get("overhead") or {}
    if overhead:
        total = total + _resource_requests(overhead)
    return total + Requests(pods=1)


def pinned_node(pod: Mapping[str, Any]) -> str | None:
    """The node an unbound pod is headed to: a required node affinity on metadata.name In [one node] (how the
    native placement pins pods), or the scheduler's nominatedNodeName (preemption in progress)."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    terms = (affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    for term in terms:
        for f in term.get("matchFields") or []:
            if (len(terms) == 1 and f.get("key") == "metadata.name" and f.get("operator") == "In"
                    and len(f.get("values") or []) == 1):
                return str(f["values"][0])
    return (pod.get("status") or {}).get("nominatedNodeName") or None


def node_of(pod: Mapping[str, Any]) -> str | None:
    """The node whose capacity a non-terminated pod takes: where it is bound, else where it is headed."""
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    return (pod.get("spec") or {}).get("nodeName") or pinned_node(pod)


def occupies_node(pod: Mapping[str, Any]) -> bool:
    """Bound (or pinned) and not terminated: its requests count against the node."""
    return node_of(pod) is not None


def used_by_node(pods: Iterable[Mapping[str, Any]]) -> dict[str, Requests]:
    used: dict[str, Requests] = {}
    for pod in pods:
        if (node := node_of(pod)) is not None:
            used[node] = used.get(node, Requests()) + pod_requests(pod)
    return used


def _ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _allocatable(node: Mapping[str, Any]) -> Node:
    """The node with its whole allocatable capacity (nothing subtracted)."""
    status = node.get("status") or {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    spec = node.get("spec") or {}
    taints = tuple(
        (str(t.get("key", "")), str(t.get("value", "") or ""), str(t.get("effect", "")))
        for t in spec.get("taints") or []
    )
    return Node(
        name=node["metadata"]["name"],
        gpus=int(parse_quantity(alloc.get(GPU_RESOURCE, 0))),
        cpu_millis=cpu_millis(alloc.get("cpu", 0)),
        memory_bytes=memory_bytes(alloc.get("memory", 0)),
        pods=int(parse_quantity(alloc["pods"])) if "pods" in alloc else None,
        other={k: amount(k, v) for k, v in alloc.items() if k not in _CORE},
        labels=dict((node.get("metadata") or {}).get("labels") or {}),
        schedulable=not spec.get("unschedulable", False),
        ready=_ready(node),
        taints=taints,
    )


def node_from_k8s(node: Mapping[str, Any], used: Requests = Requests()) -> Node:
    """One Kubernetes Node object -> the planner's Node with FREE capacity (never negative)."""
    full: Node = _memo("node", node, _allocatable)
    used_other = dict(used.other)
    return replace(
        full,
        gpus=max(0, full.gpus - used.gpus),
        cpu_millis=max(0, full.cpu_millis - used.cpu_millis),
        memory_bytes=max(0, full.memory_bytes - used.memory_bytes),
        pods=max(0, full.pods - used.pods) if full.pods is not None else None,
        other={k: max(0, v - used_other.get(k, 0)) for k, v in full.other.items()},
        labels=dict(full.labels),
    )


def inventory(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> list[Node]:
    """Every node with its free capacity after the requests of the pods already bound to it."""
    used = used_by_node(pods)
    out = [node_from_k8s(n, used.get(n["metadata"]["name"], Requests())) for n in nodes]
    return sorted(out, key=lambda n: n.name)
