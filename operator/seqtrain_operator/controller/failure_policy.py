"""Failure classification: why a gang failed decides whether and against which budget it restarts.

- permanent: restarting cannot help (the trainer rejected its config: exit code 3; an invalid image name; a
  missing ConfigMap/Secret reference) -> Failed at once.
- infrastructure: the platform took the replica away (eviction, preemption, node loss, pod deleted), the kubelet
  refused to admit the pod (OutOf<resource>, UnexpectedAdmissionError, NodeAffinity: the node's view disagreed with
  the scheduler's), or a GPU replica found no CUDA device (exit code 5: a driver/device-plugin fault) -> restart,
  counted in status.infraRestarts against faultTolerance.maxInfraRestarts; the node is avoided for a while. Exit
  code 6 (a checkpoint could not be loaded now: out of memory, a CUDA error, a storage I/O error; the checkpoint
  is kept) and exit code 7 (a write found the volume full) are infrastructure too, without avoiding the node (the
  storage is shared).
- disruption: the cluster took the replica away on purpose, from a healthy node (preemption by a higher priority,
  an eviction through the Eviction API: a drain, an autoscaler's scale-down or consolidation; the kubelet ending it
  for a graceful node shutdown: spot reclaim) -> restart, counted against no budget, and no node is avoided.
- user: everything else (a crash, OOM, SIGKILL from outside, a hang, a collective timeout) -> restart, counted in
  status.restarts against faultTolerance.maxRestarts. OOMKilled says so in the reason and names the fix.
- image pulls that fail (ErrImagePull, ImagePullBackOff) are not failures at all until
  faultTolerance.imagePullTimeoutSeconds: registries hiccup (see decide.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from seqtrain_operator.controller.types import ReplicaObservation

EXIT_INVALID_CONFIG = 3  # seqtrain.runtime.exitcodes: invalid config, permanent
EXIT_COLLECTIVE_TIMEOUT = 4  # a peer died or hung; usually a consequence, not the cause
EXIT_DEVICE_UNAVAILABLE = 5  # seqtrain.runtime.exitcodes: no CUDA device on a GPU pod: the node is broken
EXIT_CHECKPOINT_UNAVAILABLE = 6  # seqtrain.runtime.exitcodes: a checkpoint could not be loaded now (kept)
EXIT_STORAGE_FULL = 7  # seqtrain.runtime.exitcodes: a write found the volume full (ENOSPC, EDQUOT)

INFRA_REASONS = frozenset({"NodeLost", "NodeUnreachable", "Deleted", "Unschedulable", "DeadlineExceeded", "GPUUnavailable"})
# What k8s/pods/observe.py makes of a pod's DisruptionTarget condition (PreemptionByScheduler, EvictionByEvictionAPI,
# TerminationByKubelet) and of the kubelet's own reasons (node-pressure eviction, graceful node shutdown).
DISRUPTION_REASONS = frozenset({"Preempted", "Evicted", "NodeShutdown", "Shutdown", "Terminated"})
# Kubelet admission rejections (pod phase Failed, status.reason): "OutOf" + resource name, plus these.
KUBELET_ADMISSION_REASONS = frozenset({"UnexpectedAdmissionError", "NodeAffinity", "NodeSelectorMismatching",
                                       "NodeName", "NodePorts", "InvalidNodeInfo", "PodOSNotSupported"})
PERMANENT_REASONS = frozenset({"InvalidConfig", "InvalidImageName", "CreateContainerConfigError"})
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff"})


def kubelet_rejected(reason: str | None) -> bool:
    """The kubelet refused to admit the pod on its node (its view of the node disagreed with the scheduler's)."""
    return bool(reason) and (reason.startswith("OutOf") or reason in KUBELET_ADMISSION_REASONS)  # type: ignore[union-attr]


class FailureClass(str, Enum):
    USER = "User"
    INFRASTRUCTURE = "Infrastructure"
    DISRUPTION = "Disruption"
    PERMANENT = "Permanent"


@dataclass(frozen=True)
class Failure:
    cls: FailureClass
    reason: str  # short CamelCase, used as the condition/event reason
    message: str  # one line a user can act on
    replica: int | None = None
    node: str | None = None
    signature: str | None = None  # exit code + normalised error; None when the rank reported no error line
    error: str | None = None  # the rank's own error line, as reported


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code >= 128:
        import signal

        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def signature(r: ReplicaObservation) -> str | None:
    """What makes two failures "the same": the exit code and the rank's error line with every number blanked out
    (ports, pids, addresses, sizes and paths with attempt numbers change between attempts; the cause does not).
    None without an error line: an exit code alone (a SIGKILL, an OOM) says too little to call a failure repeatable."""
    if not r.error:
        return None
    return f"exit {r.exit_code}: {re.sub(r'[0-9]+', '#', r.error)}"


def ranks_of(r: ReplicaObservation, procs: int | None) -> str:
    """Which rank(s) the replica's failure is: the one its launcher reported first where the backend could tell,
    else the replica's ranks (`procs` per replica; None: unknown, and nothing is said)."""
    if r.rank is not None:
        return f"rank {r.rank}"
    if procs is None:
        return ""
    first = r.replica * procs
    return f"rank {first}" if procs == 1 else f"ranks {first}-{first + procs - 1}"


def classify(r: ReplicaObservation, procs: int | None = None) -> Failure:
    """Classify one failed replica; the message names it, its node and its rank(s) (`procs`: ranks per replica),
    the exit code and what the rank said (its error line, or the end of its log)."""
    ranks = ranks_of(r, procs)
    where = f"replica {r.replica}" + (f" on {r.node}" if r.node else "") + (f" ({ranks})" if ranks else "")
    detail = f": {r.message}" if r.message else ""
    if r.exit_code == EXIT_INVALID_CONFIG or (r.reason in PERMANENT_REASONS):
        reason = r.reason or "InvalidConfig"
        return Failure(FailureClass.PERMANENT, reason, f"{where} failed permanently ({reason}, "
                       f"{describe_exit(r.exit_code)}){detail}", r.replica, r.node)
    if r.reason in DISRUPTION_REASONS:
        return Failure(FailureClass.DISRUPTION, r.reason or "Disrupted",
                       f"{where} disrupted by the cluster ({r.reason}){detail}", r.replica, r.node)
    if r.reason in INFRA_REASONS:
        return Failure(FailureClass.INFRASTRUCTURE, r.reason or "Infrastructure",
                       f"{where} lost to infrastructure ({r.reason}){detail}", r.replica, r.node)
    if kubelet_rejected(r.reason):
        return Failure(FailureClass.INFRASTRUCTURE, "KubeletRejected",
                       f"{where}: the kubelet refused the pod ({r.reason}){detail}", r.replica, r.node)
    if r.exit_code == EXIT_DEVICE_UNAVAILABLE:
        return Failure(FailureClass.INFRASTRUCTURE, "GPUUnavailable",
                       f"{where} found no CUDA device ({describe_exit(r.exit_code)}){detail}", r.replica, r.node)
    if r.exit_code == EXIT_CHECKPOINT_UNAVAILABLE:
        return Failure(FailureClass.INFRASTRUCTURE, "CheckpointUnavailable",
                       f"{where} could not load its checkpoint now ({describe_exit(r.exit_code)}: memory, device or "
                       f"storage I/O; the checkpoint is kept){detail}", r.replica, None, error=r.error)
    if r.exit_code == EXIT_STORAGE_FULL:
        return Failure(FailureClass.INFRASTRUCTURE, "StorageFull",
                       f"{where} found its volume full ({describe_exit(r.exit_code)}: no space left on device); free "
                       f"space on the checkpoint volume (a lower checkpoint.keep, a larger claim){detail}",
                       r.replica, None, error=r.error)
    if r.reason == "OOMKilled":
        return Failure(FailureClass.USER, "OOMKilled",
                       f"{where} was OOMKilled ({describe_exit(r.exit_code)}): it exceeded its memory limit; raise "
                       f"spec.resources.memory or lower the micro-batch{detail}", r.replica, r.node)
    reason = r.reason or ("CollectiveTimeout" if r.exit_code == EXIT_COLLECTIVE_TIMEOUT else "RankFailed")
    return Failure(FailureClass.USER, reason, f"{where} failed ({reason}, {describe_exit(r.exit_code)}){detail}",
                   r.replica, r.node, signature(r), r.error)


def _rank(f: Failure, r: ReplicaObservation) -> tuple[int, int]:
    # When one rank dies the others usually fail shortly after (broken collectives). Report the cause, not the echo:
    # permanent > infrastructure (a lost node makes its peers look like user failures) > user > collective timeout.
    order = {FailureClass.PERMANENT: 0, FailureClass.INFRASTRUCTURE: 1, FailureClass.DISRUPTION: 1,
             FailureClass.USER: 2}[f.cls]
    echo = 1 if r.exit_code == EXIT_COLLECTIVE_TIMEOUT and not r.reason else 0
    return (order, echo)


def root_cause(failed: Iterable[ReplicaObservation], procs: int | None = None) -> Failure | None:
    """The failure that explains the gang's death, or None when nothing failed (`procs`: see classify)."""
    cands = [(classify(r, procs), r) for r in failed if r.phase == "Failed"]
    if not cands:
        return None
    cands.sort(key=lambda fr: (*_rank(fr[0], fr[1]), fr[1].replica))
    return cands[0][0]


def hang_failure(seconds: float, limit: int) -> Failure:
    return Failure(FailureClass.USER, "Hung", f"no training step completed for {seconds:.0f}s "
                   f"(faultTolerance.hangTimeoutSeconds = {limit})")
