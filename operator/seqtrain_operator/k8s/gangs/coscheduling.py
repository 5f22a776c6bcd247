"""kubernetes-sigs/scheduler-plugins Coscheduling: a `scheduling.x-k8s.io/v1alpha1` PodGroup and the
`scheduling.x-k8s.io/pod-group` label (apis/scheduling/v1alpha1/types.go, PodGroupLabel).

Its PodGroupSpec has minMember, minResources and scheduleTimeoutSeconds, and no queue
(manifests/coscheduling/crd.yaml): `scheduling.queue` is refused for this gang rather than written nowhere.
"""

from __future__ import annotations

from typing import Any

from seqtrain.spec import SeqTrainJob
from seqtrain_operator.k8s.gangs.base import GangScheduler, podgroup_object, times

LABEL = "scheduling.x-k8s.io/pod-group"


class Coscheduling(GangScheduler):
    def config_problem(self, job: SeqTrainJob) -> str | None:
        if job.spec.scheduling.queue:
            return ("scheduling.queue is set, but coscheduling has no queues (its PodGroup has no queue field); "
                    "remove it, or use gang: kueue / volcano / kai")
        return None

    def pod_metadata(self, job, owner, attempt):  # type: ignore[no-untyped-def]
        return {LABEL: self.group_name(job, owner, attempt)}, {}

    def podgroup(self, job, owner, attempt, meta, requests):  # type: ignore[no-untyped-def]
        s = job.spec
        spec: dict[str, Any] = {"minMember": s.replicas,
                                # the plugin's PreFilter refuses the gang early when the cluster cannot hold it
                                "minResources": {k: times(v, s.replicas) for k, v in requests.items()}}
        if s.scheduling.timeout_seconds:
            spec["scheduleTimeoutSeconds"] = s.scheduling.timeout_seconds
        return podgroup_object(self.podgroup_api or "", meta, spec)


ADAPTER = Coscheduling(name="coscheduling", crd="podgroups.scheduling.x-k8s.io",
                       scheduler_name="scheduler-plugins-scheduler", podgroup_api="scheduling.x-k8s.io/v1alpha1")
