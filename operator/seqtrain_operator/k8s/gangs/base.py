"""The one interface every external gang scheduler is wired through (Kueue's `GenericJob` idea: adding a scheduler
means adding a module here, not another `elif` in the builders and the reconciler).

Builders (`pod_metadata`, `podgroup`, `queued`, `released`) are pure: they take the job and the objects read from the
cluster and return dicts or booleans. The hooks (`on_*`) are the only I/O an adapter does, through `k8s.api.calls`; what
an adapter remembers of a job between passes it keeps in the job's `JobMemory` (k8s/cache/memory.py), never in itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from seqtrain.spec import SeqTrainJob
from seqtrain_operator.k8s.owner import Owner

if TYPE_CHECKING:
    from seqtrain_operator.k8s.api.client import Kube
    from seqtrain_operator.k8s.cache.memory import JobMemory

Pod = dict[str, Any]


@dataclass(frozen=True)
class GangScheduler:
    """Defaults: a PodGroup-style scheduler with a `minMember` PodGroup per attempt and nothing to clean up."""

    name: str  # the value of spec.scheduling.gang
    crd: str  # the CustomResourceDefinition whose presence proves the scheduler is installed
    scheduler_name: str | None = None  # pods' schedulerName (None: the default scheduler, e.g. Kueue)
    podgroup_api: str | None = None  # apiVersion of the PodGroup seqtrain writes (None: none)
    podgroup_plural: str = "podgroups"
    pods_owned_by_job: bool = True  # False: pods carry no ownerReference (KAI's pod grouper needs that)

    # ---- pure ----------------------------------------------------------------------------------------------

    def config_problem(self, job: SeqTrainJob) -> str | None:
        """A spec this scheduler cannot run (shown in the Scheduled condition), or None."""
        return None

    def group_name(self, job: SeqTrainJob, owner: Owner, attempt: int) -> str:
        return f"{owner.name}-{attempt}"

    def pod_metadata(self, job: SeqTrainJob, owner: Owner, attempt: int) -> tuple[dict[str, str], dict[str, str]]:
        """(labels, annotations) that link a pod to its gang and queue."""
        return {}, {}

    def podgroup(self, job: SeqTrainJob, owner: Owner, attempt: int, meta: dict[str, Any],
                 requests: dict[str, str]) -> dict[str, Any] | None:
        """The scheduler's PodGroup for this attempt (None: the scheduler needs none). `meta` is the operator's
        metadata (name, namespace, labels, ownerReferences); `requests` one replica's resource requests."""
        return None

    def queued(self, pod: Pod) -> bool:
        """The pod waits in the scheduler's queue (not a stuck pod): pendingGraceSeconds does not tear it down.
        Default: held by a scheduling gate, or not bound to a node (the scheduler binds a gang all at once)."""
        spec = pod.get("spec") or {}
        return bool(spec.get("schedulingGates")) or not spec.get("nodeName")

    def released(self, pod: Pod) -> bool:
        """A pod whose processes have ended and that only the scheduler's own finalizer keeps in the API (so it
        does not stop seqtrain from creating the next attempt). Default: none."""
        return False

    # ---- I/O hooks -------------------------------------------------------------------------------------------

    async def on_queued(self, kube: Kube, job: SeqTrainJob, owner: Owner, attempt: int, memory: JobMemory) -> None:
        """On every pass while the whole gang waits in the scheduler's queue (the Scheduled condition says Queued)."""

    async def on_finished(self, kube: Kube, job: SeqTrainJob, owner: Owner, pods: list[Pod], memory: JobMemory
                          ) -> None:
        """On every pass of a Succeeded or Failed job (idempotent)."""

    async def on_running(self, kube: Kube, job: SeqTrainJob, owner: Owner, boost: int, memory: JobMemory) -> None:
        """On every pass of a Running job: `boost` is its work at risk as a priority boost
        (controller.checkpoint_policy.priority_boost; 0 when off)."""

    async def on_job_deleted(self, kube: Kube, namespace: str, name: str, pods: list[Pod]) -> bool:
        """From the job's finalizer, after its pods were deleted. False: not done yet (ask again shortly)."""
        return True


def times(quantity: str, n: int) -> str:
    """n x a Kubernetes quantity, keeping its suffix ("2Gi" x 3 = "6Gi", "500m" x 4 = "2000m")."""
    digits = len(quantity) - len(quantity.lstrip("0123456789."))
    number, suffix = quantity[:digits], quantity[digits:]
    value = float(number) * n
    text = str(int(value)) if value == int(value) else f"{value:g}"
    return text + suffix


def gang_minimum(job: SeqTrainJob, requests: dict[str, str]) -> dict[str, Any]:
    """What a PodGroup (Coscheduling's, Volcano's) asks for the gang as a whole: every replica, and all their
    requests, which lets the scheduler refuse a gang the cluster cannot hold before binding any of it."""
    n = job.spec.replicas
    return {"minMember": n, "minResources": {k: times(v, n) for k, v in requests.items()}}


def podgroup_object(api: str, meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": api, "kind": "PodGroup", "metadata": meta, "spec": spec}
