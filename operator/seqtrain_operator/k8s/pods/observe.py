"""Pods and nodes as the controller core sees them (pure): Kubernetes objects -> ReplicaObservation.

What a pod's status means for the gang (the trainer container's own state decides, not the pod's: a container the
operator did not put there, e.g. a mesh proxy injected by a webhook, keeps a pod Running after the trainer exited,
or fails it after the trainer succeeded):
- trainer container terminated -> Succeeded (exit 0) or Failed with its exit code, whatever the pod phase says
  (unless the pod itself failed for a reason of its own: evicted, preempted ...);
- phase Running / Succeeded -> the same; Pending -> Pending, unless a container can never start (a bad image
  name, a broken config reference: Failed with that reason, which the core treats as permanent); a failing image
  pull (ErrImagePull, ImagePullBackOff) stays Pending with that reason: transient, the core gives it a deadline;
- phase Failed with a kubelet admission reason (OutOf<resource>, UnexpectedAdmissionError, NodeAffinity ...) ->
  Failed with that reason (infrastructure: the node is avoided);
- phase Failed -> Failed with the container's exit code; reason OOMKilled (container), Evicted (pod), or the
  DisruptionTarget condition's reason (PreemptionByScheduler -> Preempted, DeletionByTaintManager -> NodeLost,
  EvictionByEvictionAPI / TerminationByKubelet -> Evicted);
- deletionTimestamp set -> Failed, Deleted, terminating (the core knows whether it asked for the deletion: a
  teardown it ordered is never charged); overdue once the grace period ended over a minute ago on a Ready node with
  no finalizer holding it (the core then force-deletes it, saying so);
- on a node that is NotReady/unreachable for longer than a grace period -> Failed, NodeUnreachable: the node may
  be partitioned, not dead, and its pods may still run and write checkpoints, so they are never force-deleted on
  that evidence (split brain); the gang waits, saying how to confirm the node is down;
- on such a node once it carries the out-of-service taint (node.kubernetes.io/out-of-service: an admin or their
  automation confirmed it is down, Kubernetes' non-graceful node shutdown), or removed -> Failed, NodeLost,
  node_lost (once deleted the pod keeps its deletionTimestamp forever: no kubelet confirms; the core then
  force-deletes it, and the pod garbage collector does the same on an out-of-service node).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from types import MappingProxyType
from typing import Any

from seqtrain.runtime.exitcodes import last_error
from seqtrain.runtime.restart import rounds_in
from seqtrain.spec.progress_doc import Reported, reported_or_nothing
from seqtrain.spec.replica_env import first_rank_exit
from seqtrain_operator.controller.clock import parse, seconds_between
from seqtrain_operator.controller.failure_policy import IMAGE_PULL_REASONS, kubelet_rejected
from seqtrain_operator.controller.types import ReplicaObservation
from seqtrain_operator.k8s.pods.manifests import CONTAINER, LABEL_ATTEMPT, LABEL_REPLICA

# Reasons a container cannot start that retrying will not fix. Image pulls are not among them: a registry hiccup
# on a large CUDA image must not fail a job (the core gives them faultTolerance.imagePullTimeoutSeconds).
_NEVER_STARTS = frozenset({"InvalidImageName", "CreateContainerConfigError", "CreateContainerError"})
# FallbackToLogsOnError: the kubelet keeps the log's last 2048 bytes (or 80 lines) as the termination message.
_FALLBACK_BYTES = 2048
# The trainer's per-step console line (seqtrain.train.loop.Trainer.log_step): progress, never a failure's reason.
_PROGRESS_LINE = re.compile(r"^step \d+/\d+ ")
# A kubelet SIGKILLs a pod's containers when its grace period ends and confirms the deletion at once; a pod still
# there this long after that, on a Ready node, is stuck (a wedged kubelet or runtime): the core force-deletes it.
TERMINATION_OVERDUE_SECONDS = 60.0
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
_DISRUPTION = MappingProxyType({"PreemptionByScheduler": "Preempted", "DeletionByTaintManager": "NodeLost",
                                "EvictionByEvictionAPI": "Evicted", "TerminationByKubelet": "Evicted"})


def _container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The trainer's containerStatus ({} before the kubelet reports it); never another container's."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((c for c in statuses if c.get("name") == CONTAINER), {})


def _outcome(phase: str, term: Mapping[str, Any], pod: Mapping[str, Any]) -> str:
    """The pod phase corrected by the trainer's exit: a trainer that exited beside a running sidecar ends the
    replica; one that exited 0 beside a sidecar that failed succeeded (unless the pod failed for its own reason)."""
    code = term.get("exitCode")
    if code is None:
        return phase
    if phase == "Running":
        return "Succeeded" if code == 0 else "Failed"
    if phase == "Failed" and code == 0 and not (pod.get("status") or {}).get("reason") and not _disruption(pod):
        return "Succeeded"
    return phase


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return (_container(pod).get("state") or {}).get("terminated") or {}


def _disruption(pod: Mapping[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return _DISRUPTION.get(c.get("reason", ""), "Evicted")
    return None


def not_ready_for(node: Mapping[str, Any], now: datetime) -> float | None:
    """Seconds the node has not been Ready (None: it is Ready or reports no Ready condition yet)."""
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            if c.get("status") == "True":
                return None
            since = parse(c.get("lastTransitionTime"))
            return seconds_between(since, now) if since else float("inf")
    return None


def out_of_service(node: Mapping[str, Any]) -> bool:
    """An admin (or their automation) confirmed the node is down: Kubernetes' non-graceful node shutdown taint."""
    return any(t.get("key") == OUT_OF_SERVICE for t in (node.get("spec") or {}).get("taints") or [])


def replica_of(pod: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]], now: datetime,
               node_lost_grace: float = 40.0,
               termination_overdue: float = TERMINATION_OVERDUE_SECONDS) -> ReplicaObservation | None:
    """One pod -> its replica observation (None for a pod without our labels). `termination_overdue`: seconds
    past its grace period a pod may stay Terminating on a Ready node before it counts as overdue."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        replica, attempt = int(labels[LABEL_REPLICA]), int(labels[LABEL_ATTEMPT])
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName")
    term = _terminated(pod)
    phase = _outcome(status.get("phase", "Pending"), term, pod)
    code = term.get("exitCode")
    reason: str | None = None
    message = status.get("message", "") or ""
    error: str | None = None

    rank: int | None = None
    if phase in ("Failed", "Unknown"):
        phase = "Failed"
        rank = _failed_rank(pod, term.get("message"))
        reason = "OOMKilled" if term.get("reason") == "OOMKilled" else None
        reason = reason or (status.get("reason") if status.get("reason") in ("Evicted", "Shutdown", "NodeShutdown",
                                                                             "DeadlineExceeded", "Terminated")
                                                    or kubelet_rejected(status.get("reason"))
                            else None) or _disruption(pod)
        if not _looks_like_json(term.get("message")):
            error = last_error(term.get("message"))
            message = message or failure_message(term.get("message"))
    elif phase == "Pending":
        waiting = (_container(pod).get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _NEVER_STARTS:
            phase, reason, message = "Failed", waiting["reason"], waiting.get("message", "")
        elif waiting.get("reason") in IMAGE_PULL_REASONS:
            reason, message = waiting["reason"], waiting.get("message", "")
    terminating = bool(meta.get("deletionTimestamp"))
    if phase in ("Pending", "Running") and terminating:
        # Who deleted it, when the API says (the taint manager evicting pods of a NotReady node: NodeLost).
        phase, reason = "Failed", _disruption(pod) or "Deleted"
    node_lost = node_unready = False
    if node:
        gone = node not in nodes
        down = None if gone else not_ready_for(nodes[node], now)
        unreachable = down is not None and down >= node_lost_grace
        node_lost = gone or (unreachable and out_of_service(nodes[node]))
        node_unready = gone or down is not None
        if (node_lost or unreachable) and (phase in ("Pending", "Running")
                                           or (terminating and reason in ("Deleted", "NodeLost"))):
            phase, reason = "Failed", "NodeLost" if node_lost else "NodeUnreachable"
            if gone:
                message = f"node {node} was removed"
            elif node_lost:
                message = f"node {node} has not been Ready for {down:.0f}s and is out of service"
            else:
                message = (f"node {node} has not been Ready for {down:.0f}s; its pods may still run: once it is "
                           f"known to be down, taint it {OUT_OF_SERVICE}=nodeshutdown:NoExecute (or delete the Node)")
    if phase == "Failed" and reason is None and _disruption(pod):
        reason = _disruption(pod)
    due = parse(meta.get("deletionTimestamp"))  # the API sets it to when the grace period ends
    overdue = (terminating and bool(node) and not node_unready and not meta.get("finalizers") and due is not None
               and seconds_between(due, now) > termination_overdue)
    return ReplicaObservation(replica=replica, attempt=attempt, phase=phase,  # type: ignore[arg-type]
                              exit_code=code, reason=reason, node=node, message=message, terminating=terminating,
                              node_lost=node_lost, node_unready=node_unready, overdue=overdue,
                              finished_at=term.get("finishedAt"), error=error,
                              restart_round=rounds_in(term.get("message")), placed_at=_placed_at(pod), rank=rank)


def _failed_rank(pod: Mapping[str, Any], message: str | None) -> int | None:
    """The rank a multi-rank pod's launcher reported ending first, when its termination message fell back to the
    log (None otherwise: the core then names the pod's ranks), from the identity the pod was given."""
    first = first_rank_exit(message)
    if first is None:
        return None
    trainer = next((c for c in (pod.get("spec") or {}).get("containers") or [] if c.get("name") == CONTAINER), {})
    env = {e.get("name"): e.get("value") for e in trainer.get("env") or []}
    try:
        return int(env["NODE_RANK"]) * int(env["LOCAL_WORLD_SIZE"]) + first[0]
    except (KeyError, TypeError, ValueError):
        return None


def _placed_at(pod: Mapping[str, Any]) -> str | None:
    """When kube-scheduler bound the pod (its PodScheduled condition turned True)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "True":
            return c.get("lastTransitionTime")
    return None


def failure_message(text: str | None) -> str:
    """Why a replica failed, in one line, from its container's termination message: what the trainer wrote there
    (its error line), or with FallbackToLogsOnError the end of its log. The trainer's error line (the last line
    with the error marker) wherever it is, progress output after it included; without one, the last whole line
    that is not per-step progress output; "" for nothing usable (then the exit code says it all). The kubelet cuts
    the log's tail at 2048 bytes, so the first line of a tail that long may start mid-line: it is never used."""
    if not text or _looks_like_json(text):
        return ""
    error = last_error(text)
    if error:
        return error
    lines = text.splitlines()
    if len(text.encode("utf-8", "replace")) >= _FALLBACK_BYTES:
        lines = lines[1:]
    for line in reversed(lines):
        line = line.strip()
        if line and not _PROGRESS_LINE.match(line):
            return line[:300]
    return ""


def _looks_like_json(text: str | None) -> bool:
    return bool(text) and text.lstrip().startswith("{")  # type: ignore[union-attr]


def observe_replicas(pods: Iterable[Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]], now: datetime,
                     node_lost_grace: float = 40.0, termination_overdue: float = TERMINATION_OVERDUE_SECONDS
                     ) -> tuple[ReplicaObservation, ...]:
    by_name = {n["metadata"]["name"]: n for n in nodes}
    out = [r for p in pods if (r := replica_of(p, by_name, now, node_lost_grace, termination_overdue)) is not None]
    return tuple(sorted(out, key=lambda r: (r.attempt, r.replica)))


def awaiting_scheduler(pod: Mapping[str, Any]) -> bool:
    """Created, not bound, and not refused by kube-scheduler (no PodScheduled=False): still in the scheduler's
    queue. Not stuck: a burst of thousands of pods takes the scheduler a while, and tearing such a gang down
    would only send it to the back of the queue."""
    status = pod.get("status") or {}
    if status.get("phase", "Pending") != "Pending" or (pod.get("spec") or {}).get("nodeName"):
        return False
    return not any(c.get("type") == "PodScheduled" and c.get("status") == "False"
                   for c in status.get("conditions") or [])


def progress_from_json(data: bytes | str | Mapping[str, Any]) -> Reported:
    """The trainer's progress document (GET /progress, a push, or the termination message), raw or decoded -> what
    it reports; `Reported()` (nothing) for anything the one reader refuses (seqtrain.spec.progress_doc)."""
    return reported_or_nothing(data)


def final_progress(pods: Iterable[Mapping[str, Any]], attempt: int) -> Reported:
    """Progress rank 0 left in its termination message when it exited (the HTTP server is gone by then)."""
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_REPLICA) == "0" and labels.get(LABEL_ATTEMPT) == str(attempt):
            text = _terminated(pod).get("message")
            if _looks_like_json(text):
                return progress_from_json(text)  # type: ignore[arg-type]
    return Reported()


def rank0_ip(pods: Iterable[Mapping[str, Any]], attempt: int) -> str | None:
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        status = pod.get("status") or {}
        if (labels.get(LABEL_REPLICA) == "0" and labels.get(LABEL_ATTEMPT) == str(attempt)
                and status.get("phase") == "Running" and not _terminated(pod)):
            return status.get("podIP")  # not once the trainer exited: its endpoint is gone
    return None
