"""What the operator's caches keep of a pod or a node (pure): the fields placement, observation and the gang
scheduler adapters read, in the API's own shape (every reader works on a projection as on the whole object).

Why: kopf's indexes kept whole bodies: managedFields, the trainer's env and volumes, every container's image
and IDs, a node's image list and system info, about 150 KB a pod with its history; 8000 pods made 1.36 GiB of
operator RSS. A projection keeps a few hundred bytes.

Kept of a pod: name, namespace, uid, resourceVersion (the inventory memoizes by it), labels, annotations,
finalizers, deletionTimestamp, the ownerReferences' kind, uid and controller flag (whose pod it is); nodeName,
schedulingGates, the node affinity (a pod pinned to a node), the containers' names and resources, overhead; phase,
reason, message, podIP, nominatedNodeName, the conditions' type, status and reason (and when PodScheduled changed:
when it was placed), the containers' names and
current states (a terminated state's message is rank 0's final progress).
Of a node: name, uid, resourceVersion, labels; unschedulable, taints; allocatable, capacity, and the Ready
condition (status and since when).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_META = ("name", "namespace", "uid", "resourceVersion", "labels", "finalizers", "deletionTimestamp")
_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def _pick(src: Mapping[str, Any] | None, keys: tuple[str, ...]) -> dict[str, Any]:
    src = src or {}
    return {k: src[k] for k in keys if src.get(k) is not None}


def _containers(items: Any) -> list[dict[str, Any]]:
    return [_pick(c, ("name", "resources")) for c in items or []]


def pod(body: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    m = _pick(meta, _META)
    if refs := [_pick(r, ("kind", "uid", "controller")) for r in meta.get("ownerReferences") or []]:
        m["ownerReferences"] = refs  # whose pod it is (k8s/manifests.owner_uid), beside the job-uid label
    if annotations := {k: v for k, v in (meta.get("annotations") or {}).items() if k != _LAST_APPLIED}:
        m["annotations"] = annotations
    s = _pick(spec, ("nodeName", "schedulingGates", "overhead", "schedulerName"))
    if node_affinity := (spec.get("affinity") or {}).get("nodeAffinity"):
        s["affinity"] = {"nodeAffinity": node_affinity}
    s["containers"] = _containers(spec.get("containers"))
    if spec.get("initContainers"):
        s["initContainers"] = _containers(spec["initContainers"])
    st = _pick(status, ("phase", "reason", "message", "podIP", "nominatedNodeName"))
    if status.get("conditions"):
        st["conditions"] = [_pick(c, ("type", "status", "reason") + (("lastTransitionTime",) if c.get("type") ==
                                                                      "PodScheduled" else ()))
                            for c in status["conditions"]]
    if status.get("containerStatuses"):
        st["containerStatuses"] = [_pick(c, ("name", "state")) for c in status["containerStatuses"]]
    return {"metadata": m, "spec": s, "status": st}


def node(body: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    st = _pick(status, ("allocatable", "capacity"))
    st["conditions"] = [_pick(c, ("type", "status", "lastTransitionTime"))
                        for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return {"metadata": _pick(meta, ("name", "uid", "resourceVersion", "labels")),
            "spec": _pick(spec, ("unschedulable", "taints")), "status": st}
