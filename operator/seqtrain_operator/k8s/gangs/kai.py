"""NVIDIA KAI Scheduler: a `scheduling.run.ai/v2alpha2` PodGroup that seqtrain writes, pods annotated
`pod-group-name` and labelled `kai.scheduler/queue`, schedulerName `kai-scheduler`.

KAI's pod grouper (pkg/podgrouper/pod_controller.go) builds a PodGroup for every pod from its top owner; an owner
kind it does not know gets the default grouper's PodGroup `pg-<owner>-<uid>` with minMember 1, and the pod's
`pod-group-name` annotation is overwritten to point at it: no gang. The one case it leaves alone is the one KAI
documents for workloads it does not know (docs/topology/multilevel.md: pods that name a PodGroup the user
created): a pod with a `pod-group-name` annotation and no ownerReferences (isOrphanPodWithPodGroup). So for KAI
the pods carry no ownerReference; the PodGroup, ConfigMap and Service keep theirs, and the operator deletes the
pods itself (every gang teardown, and the job's finalizer).

scheduling.topology (with its `name`: the Topology object KAI reads) becomes the PodGroup's topologyConstraint.
KAI's Go module is not served by this machine's module proxy, so neither its controller nor its CRD schema runs
in the tests: the field names follow its v2alpha2 types.
"""

from __future__ import annotations

from typing import Any

from seqtrain.spec import SeqTrainJob
from seqtrain_operator.k8s.gangs.base import GangScheduler, podgroup_object

GROUP_ANNOTATION = "pod-group-name"
QUEUE_LABEL = "kai.scheduler/queue"
DEFAULT_QUEUE = "default-queue"  # KAI's own default (pkg/podgrouper/podgrouper/plugins/constants)


def _queue(job: SeqTrainJob) -> str:
    return job.spec.scheduling.queue or DEFAULT_QUEUE


class Kai(GangScheduler):
    def pod_metadata(self, job, owner, attempt):  # type: ignore[no-untyped-def]
        return {QUEUE_LABEL: _queue(job)}, {GROUP_ANNOTATION: self.group_name(job, owner, attempt)}

    def podgroup(self, job, owner, attempt, meta, requests):  # type: ignore[no-untyped-def]
        s = job.spec
        spec: dict[str, Any] = {"minMember": s.replicas, "queue": _queue(job)}
        if s.scheduling.priority_class_name:
            spec["priorityClassName"] = s.scheduling.priority_class_name
        if (constraint := topology_constraint(job)) is not None:
            spec["topologyConstraint"] = constraint
        labels = {**meta.get("labels", {}), QUEUE_LABEL: _queue(job)}
        return podgroup_object(self.podgroup_api or "", {**meta, "labels": labels}, spec)


def topology_constraint(job: SeqTrainJob) -> dict[str, str] | None:
    """scheduling.topology as KAI's PodGroup topologyConstraint (pkg/apis/scheduling/v2alpha2: the Topology object's
    name and a level, which is a node label key of it): `require` keeps the gang in one domain of the innermost key,
    `pack` prefers one. Only a topology the spec sets is passed on (validation asks for its name)."""
    topo = job.spec.scheduling.topology
    if "topology" not in job.spec.scheduling.model_fields_set or not topo.keys or not topo.name:
        return None
    if topo.policy == "require":
        return {"topology": topo.name, "requiredTopologyLevel": topo.keys[-1]}
    if topo.policy == "pack":
        return {"topology": topo.name, "preferredTopologyLevel": topo.keys[-1]}
    return None


ADAPTER = Kai(name="kai", crd="podgroups.scheduling.run.ai", scheduler_name="kai-scheduler",
              podgroup_api="scheduling.run.ai/v2alpha2", pods_owned_by_job=False)
