"""What the operator's caches keep of a pod or a node (pure): the fields placement, observation and the gang
scheduler adapters read, in the API's own shape (every reader works on a projection as on the whole object).

Why: kopf's indexes kept whole bodies: managedFields, the trainer's env and volumes, every container's image
and IDs, a node's image list and system info, about 150 KB a pod with its history; 8000 pods made 1.36 GiB of
operator RSS. A projection keeps a few hundred bytes.

Kept of a pod: name, namespace, uid, resourceVersion (the inventory memoizes by it), labels, annotations,
finalizers, deletionTimestamp, the ownerReferences' kind, uid and controller flag (whose pod it is); nodeName,
schedulingGates, the node affinity (a pod pinned to a node), the containers' names and resources, overhead; phase,
reason, message, podIP, nominatedNodeName, the PodScheduled and DisruptionTarget conditions' type, status and reason
(and when PodScheduled changed: when it was placed), the containers' names and
current states (a terminated state's message is rank 0's final progress).
Of a job (what a reconcile pass reads, and what the operator keeps of its last status write): everything but
metadata.managedFields and kubectl's last-applied annotation. As Python objects managedFields is most of a job
(every "f:field" of the server-side-apply history is a dict of its own); deep copies and decoded write responses
were the largest live allocations at the peak of a 300-job run (docs/benchmarks.md).
Of a node: name, uid, resourceVersion, labels; unschedulable, taints; allocatable, capacity, and the Ready
condition (status and since when).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from typing import Any

_META = ("name", "namespace", "uid", "resourceVersion", "labels", "finalizers", "deletionTimestamp")
# The pod conditions anything reads: placement (observe.awaiting_scheduler, the Starting condition) and disruptions.
_POD_CONDITIONS = ("PodScheduled", "DisruptionTarget")
_SHARED_MAX = 64  # longer strings (a terminated container's message) are rarely repeated


def compact(obj: Any) -> Any:
    """A copy whose keys and short strings are shared with every other pod's (sys.intern): each decoded watch event
    has its own copies of "metadata", label keys and values, quantities; the operator keeps 8000 pods."""
    if isinstance(obj, dict):
        return {sys.intern(k): compact(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [compact(v) for v in obj]
    if isinstance(obj, str) and len(obj) <= _SHARED_MAX:
        return sys.intern(obj)
    return obj


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
        m["ownerReferences"] = refs  # whose pod it is (k8s/owner.owner_uid), beside the job-uid label
    if annotations := {k: v for k, v in (meta.get("annotations") or {}).items() if k != _LAST_APPLIED}:
        m["annotations"] = annotations
    s = _pick(spec, ("nodeName", "schedulingGates", "overhead", "schedulerName"))
    if node_affinity := (spec.get("affinity") or {}).get("nodeAffinity"):
        s["affinity"] = {"nodeAffinity": node_affinity}
    s["containers"] = _containers(spec.get("containers"))
    if spec.get("initContainers"):
        s["initContainers"] = _containers(spec["initContainers"])
    st = _pick(status, ("phase", "reason", "message", "podIP", "nominatedNodeName"))
    if conditions := [c for c in status.get("conditions") or [] if c.get("type") in _POD_CONDITIONS]:
        st["conditions"] = [_pick(c, ("type", "status", "reason") + (("lastTransitionTime",) if c.get("type") ==
                                                                      "PodScheduled" else ()))
                            for c in conditions]
    if status.get("containerStatuses"):
        st["containerStatuses"] = [_pick(c, ("name", "state")) for c in status["containerStatuses"]]
    return compact({"metadata": m, "spec": s, "status": st})


def node(body: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    st = _pick(status, ("allocatable", "capacity"))
    st["conditions"] = [_pick(c, ("type", "status", "lastTransitionTime"))
                        for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return compact({"metadata": _pick(meta, ("name", "uid", "resourceVersion", "labels")),
                    "spec": _pick(spec, ("unschedulable", "taints")), "status": st})


def job(body: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a SeqTrainJob a pass may change freely, without what no pass reads (see the module's docstring)."""
    meta = {k: copy.deepcopy(v) for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    if _LAST_APPLIED in (meta.get("annotations") or {}):
        meta["annotations"] = {k: v for k, v in meta["annotations"].items() if k != _LAST_APPLIED}
    return {**{k: copy.deepcopy(v) for k, v in body.items() if k != "metadata"}, "metadata": meta}
