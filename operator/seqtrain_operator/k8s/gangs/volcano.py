"""Volcano: a `scheduling.volcano.sh/v1beta1` PodGroup, the pod annotations `scheduling.k8s.io/group-name`
(KubeGroupNameAnnotationKey) and `scheduling.volcano.sh/queue-name` (QueueNameAnnotationKey,
staging/src/volcano.sh/apis/pkg/apis/scheduling/v1beta1/labels.go), schedulerName `volcano`.

scheduling.topology set in the spec becomes the PodGroup's `networkTopology` (Volcano >= 1.12, HyperNodes): Volcano
counts topology in HyperNode tiers (1 = the smallest switch domain), not node labels, so `require` asks for one
tier-1 HyperNode (`mode: hard, highestTierAllowed: 1`) and `pack` prefers one (`mode: soft`); which nodes share a
tier-1 HyperNode is the cluster's HyperNode configuration (e.g. its label-based discovery of the same keys)."""

from __future__ import annotations

from typing import Any

from seqtrain.spec import SeqTrainJob
from seqtrain_operator.k8s.gangs.base import GangScheduler, gang_minimum, podgroup_object

GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"


class Volcano(GangScheduler):
    def pod_metadata(self, job, owner, attempt):  # type: ignore[no-untyped-def]
        annotations = {GROUP_ANNOTATION: self.group_name(job, owner, attempt)}
        if job.spec.scheduling.queue:
            annotations[QUEUE_ANNOTATION] = job.spec.scheduling.queue
        return {}, annotations

    def podgroup(self, job, owner, attempt, meta, requests):  # type: ignore[no-untyped-def]
        s = job.spec
        spec = gang_minimum(job, requests)
        if s.scheduling.queue:
            spec["queue"] = s.scheduling.queue
        if s.scheduling.priority_class_name:
            spec["priorityClassName"] = s.scheduling.priority_class_name
        if (topology := network_topology(job)) is not None:
            spec["networkTopology"] = topology
        return podgroup_object(self.podgroup_api or "", meta, spec)


def network_topology(job: SeqTrainJob) -> dict[str, Any] | None:
    if "topology" not in job.spec.scheduling.model_fields_set:
        return None  # not asked for: a cluster without HyperNodes must not hold the gang back
    policy = job.spec.scheduling.topology.policy
    if policy == "require":
        return {"mode": "hard", "highestTierAllowed": 1}
    if policy == "pack":
        return {"mode": "soft"}
    return None


ADAPTER = Volcano(name="volcano", crd="podgroups.scheduling.volcano.sh", scheduler_name="volcano",
                  podgroup_api="scheduling.volcano.sh/v1beta1")
