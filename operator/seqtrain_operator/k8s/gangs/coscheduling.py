"""kubernetes-sigs/scheduler-plugins Coscheduling: a `scheduling.x-k8s.io/v1alpha1` PodGroup and the
`scheduling.x-k8s.io/pod-group` label (apis/scheduling/v1alpha1/types.go, PodGroupLabel).

Its PodGroupSpec has minMember, minResources and scheduleTimeoutSeconds, and no queue
(manifests/coscheduling/crd.yaml): `scheduling.queue` is refused for this gang rather than written nowhere.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from seqtrain.spec import SeqTrainJob
from seqtrain_operator.k8s.api import calls
from seqtrain_operator.k8s.gangs.base import GangScheduler, gang_minimum, podgroup_object

LABEL = "scheduling.x-k8s.io/pod-group"
RETRY_ANNOTATION = "seqtrain.dev/retry-scheduling"
# The plugin asks kube-scheduler to retry a gang it refused only when a pod is added or a PodGroup is added or
# updated (Coscheduling.EventsToRegister): not when pods are deleted. A gang refused for want of room would wait
# for podMaxInUnschedulablePodsDuration (5 min) after room freed, unless something else happened to be created.
# Touching the PodGroup of a queued gang this often bounds that wait.
RETRY_SECONDS = 20.0


class Coscheduling(GangScheduler):
    def config_problem(self, job: SeqTrainJob) -> str | None:
        if job.spec.scheduling.queue:
            return ("scheduling.queue is set, but coscheduling has no queues (its PodGroup has no queue field); "
                    "remove it, or use gang: kueue / volcano / kai")
        return None

    def pod_metadata(self, job, owner, attempt):  # type: ignore[no-untyped-def]
        return {LABEL: self.group_name(job, owner, attempt)}, {}

    def podgroup(self, job, owner, attempt, meta, requests):  # type: ignore[no-untyped-def]
        spec = gang_minimum(job, requests)  # the plugin's PreFilter refuses a gang the cluster cannot hold
        if job.spec.scheduling.timeout_seconds:
            spec["scheduleTimeoutSeconds"] = job.spec.scheduling.timeout_seconds
        return podgroup_object(self.podgroup_api or "", meta, spec)

    async def on_queued(self, kube, job, owner, attempt, memory):  # type: ignore[no-untyped-def]
        group, now = self.group_name(job, owner, attempt), time.monotonic()
        if memory.touched is not None and memory.touched[0] == group and now - memory.touched[1] < RETRY_SECONDS:
            return
        memory.touched = (group, now)
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await calls.patch_custom(kube, self.podgroup_api or "", self.podgroup_plural, owner.namespace, group,
                                 {"metadata": {"annotations": {RETRY_ANNOTATION: stamp}}})


ADAPTER = Coscheduling(name="coscheduling", crd="podgroups.scheduling.x-k8s.io",
                       scheduler_name="scheduler-plugins-scheduler", podgroup_api="scheduling.x-k8s.io/v1alpha1")
