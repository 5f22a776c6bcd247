"""Kueue plain pod groups (KEP-976; pkg/controller/jobs/pod): the label `kueue.x-k8s.io/queue-name`, the label
`kueue.x-k8s.io/pod-group-name` and the annotation `kueue.x-k8s.io/pod-group-total-count` on every pod, the default
scheduler. Kueue's webhook gates each pod (`kueue.x-k8s.io/admission`) and adds its finalizer
`kueue.x-k8s.io/managed`; its controller creates a Workload named after the group and ungates the pods when the
LocalQueue's ClusterQueue admits it.

How seqtrain fits Kueue's group life cycle:
- one group name for the whole job (`<job>-<uid prefix>`), not one per attempt: Kueue keeps an admitted group's
  Workload and treats the next attempt's pods as replacements of the failed ones (it removes the finalizer of the
  replaced pods and ungates the new ones without queueing again), so a gang restart keeps its admission;
- a pod that has ended, is being deleted and is kept only by Kueue's finalizer is `released`: it no longer stops the
  next attempt from being created (otherwise the two wait on each other: Kueue frees the old pods only once their
  replacements exist);
- gated pods are `queued`: a job waiting in its LocalQueue is not torn down after pendingGraceSeconds;
- while it runs, with the operator's --kueue-priority-boost-seconds set, its Workload's annotation
  `kueue.x-k8s.io/priority-boost` follows the work at risk (KEP-7990, Kueue's PriorityBoost gate): Kueue orders
  preemption candidates by priority + boost, so it takes the job that loses the least; written when it changes;
- when the job ends, its pods get `kueue.x-k8s.io/retriable-in-group: "false"` so Kueue finishes the Workload and
  drops its finalizers; once no pod carries the finalizer the Workload is deleted; when the job is deleted the
  operator also removes the finalizer from its own ended pods (Kueue may be gone by then) and deletes the Workload.
"""

from __future__ import annotations

import logging

from seqtrain.spec import SeqTrainJob
from seqtrain_operator.k8s.api import calls
from seqtrain_operator.k8s.gangs.base import GangScheduler, Pod
from seqtrain_operator.k8s.owner import LABEL_REPLICA

log = logging.getLogger("seqtrain.operator")

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
FINALIZER = "kueue.x-k8s.io/managed"
GATE = "kueue.x-k8s.io/admission"
WORKLOAD_GROUP = "kueue.x-k8s.io"
# Kueue v0.15 added v1beta2, v0.16 made it the storage version and v0.20 stops serving v1beta1: the adapter speaks
# the first of these that the installed Workload CRD serves. Every field it touches (metadata.annotations, the
# object's name and deletion) is the same in both versions.
WORKLOAD_VERSIONS = ("v1beta2", "v1beta1")
WORKLOADS = "workloads"
WORKLOAD_CRD = f"{WORKLOADS}.{WORKLOAD_GROUP}"
BOOST_ANNOTATION = "kueue.x-k8s.io/priority-boost"
# Topology-Aware Scheduling (beta, on by default since v0.14): a pod group's request for one domain of a level of
# the ClusterQueue flavor's Topology. Kueue gates the pods (`kueue.x-k8s.io/topology`) until it has chosen nodes.
REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
UNCONSTRAINED_TOPOLOGY = "kueue.x-k8s.io/podset-unconstrained-topology"
# Which label holds a pod's index in its group: TAS's ungater then gives the chosen domains to the pods in rank order
# (ranks 0..k-1 fill the first domain, and so on), so tensor-parallel peers and pipeline neighbours, which are
# consecutive ranks, share the smallest domain Kueue found rather than wherever the greedy fill put them. Kueue's
# pod webhook copies our replica label into `kueue.x-k8s.io/pod-group-pod-index` from it.
INDEX_LABEL_ANNOTATION = "kueue.x-k8s.io/pod-group-pod-index-label"


def topology_request(job: SeqTrainJob) -> dict[str, str]:
    """scheduling.topology as Kueue's TAS annotation. `keys` are outermost first, so the last one names the
    smallest domain the gang should share: `require` asks for one such domain (the gang waits until one has room),
    `pack` prefers one (Kueue falls back to as few domains as fit), `spread` and `none` ask for no domain.
    Only a topology the spec sets is passed on: Kueue admits a TAS request only through a flavor that names a
    Topology, so the default (`pack` by zone) must not make every job unadmissible on a queue without one."""
    if "topology" not in job.spec.scheduling.model_fields_set:
        return {}
    topo = job.spec.scheduling.topology
    if topo.policy == "require" and topo.keys:
        return {REQUIRED_TOPOLOGY: topo.keys[-1]}
    if topo.policy == "pack" and topo.keys:
        return {PREFERRED_TOPOLOGY: topo.keys[-1]}
    return {}


def workload_api(served: list[str]) -> str | None:
    """The apiVersion to use for Workloads, given the versions their CRD serves (None: none we speak)."""
    return next((f"{WORKLOAD_GROUP}/{v}" for v in WORKLOAD_VERSIONS if v in served), None)


async def _workload_api(kube) -> str | None:  # type: ignore[no-untyped-def]
    # Kube.served_versions logs the served versions when first read and whenever they change.
    return workload_api(await kube.served_versions(WORKLOAD_CRD))


def group_name_for(name: str, uid: str) -> str:
    # Unique per job object (a deleted and re-created job must not adopt the old Workload), stable across attempts;
    # a valid label value and resource name: <= 50 + 1 + 8 characters.
    return f"{name}-{uid.replace('-', '')[:8]}"


def _terminated(pod: Pod) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return True
    states = [c.get("state") or {} for c in status.get("containerStatuses") or []]
    return bool(states) and all("terminated" in s for s in states)


class Kueue(GangScheduler):
    def config_problem(self, job: SeqTrainJob) -> str | None:
        if not job.spec.scheduling.queue:
            return "scheduling.gang kueue needs scheduling.queue (the name of a Kueue LocalQueue in this namespace)"
        return None

    def group_name(self, job, owner, attempt):  # type: ignore[no-untyped-def]
        return group_name_for(owner.name, owner.uid)

    def pod_metadata(self, job, owner, attempt):  # type: ignore[no-untyped-def]
        labels = {GROUP_LABEL: self.group_name(job, owner, attempt)}
        if job.spec.scheduling.queue:
            labels[QUEUE_LABEL] = job.spec.scheduling.queue
        return labels, {TOTAL_ANNOTATION: str(job.spec.replicas), INDEX_LABEL_ANNOTATION: LABEL_REPLICA,
                        **topology_request(job)}

    def queued(self, pod: Pod) -> bool:
        return GATE in [g.get("name") for g in (pod.get("spec") or {}).get("schedulingGates") or []]

    def released(self, pod: Pod) -> bool:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        if not meta.get("deletionTimestamp") or FINALIZER not in (meta.get("finalizers") or []):
            return False
        never_started = bool(spec.get("schedulingGates")) and not spec.get("nodeName")  # deleted while queued
        return _terminated(pod) or never_started

    async def _mark_unretriable(self, kube, pods: list[Pod]) -> None:  # type: ignore[no-untyped-def]
        for pod in pods:
            meta = pod["metadata"]
            if (meta.get("annotations") or {}).get(RETRIABLE_ANNOTATION) != "false":
                await calls.patch_pod(kube, meta["namespace"], meta["name"],
                                      {"metadata": {"annotations": {RETRIABLE_ANNOTATION: "false"}}})

    async def on_running(self, kube, job, owner, boost, memory):  # type: ignore[no-untyped-def]
        # the boost last written is remembered (memory.boost): a pass writes only a change; a new operator writes
        # each running job's once more (it may have changed meanwhile)
        key = (owner.namespace, self.group_name(job, owner, 0))
        if memory.boost == boost:
            return
        # a string, as annotations are; a Workload not created yet (404) is tried again on the next pass
        if (api := await _workload_api(kube)) is None:
            return
        if await calls.patch_custom(kube, api, WORKLOADS, key[0], key[1],
                                    {"metadata": {"annotations": {BOOST_ANNOTATION: str(boost)}}}):
            memory.boost = boost
            log.info("%s/%s: Workload %s priority boost %d (work at risk)", owner.namespace, owner.name, key[1], boost)

    async def on_finished(self, kube, job, owner, pods, memory):  # type: ignore[no-untyped-def]
        group = self.group_name(job, owner, 0)
        memory.boost = None
        mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(GROUP_LABEL) == group]
        await self._mark_unretriable(kube, mine)
        if not any(FINALIZER in (p["metadata"].get("finalizers") or []) for p in mine) \
                and (api := await _workload_api(kube)) is not None:
            await calls.delete_custom(kube, api, WORKLOADS, owner.namespace, group)

    async def on_job_deleted(self, kube, namespace, name, pods):  # type: ignore[no-untyped-def]
        mine = [p for p in pods if GROUP_LABEL in (p["metadata"].get("labels") or {})]
        if not mine:
            return True
        await self._mark_unretriable(kube, mine)
        api = await _workload_api(kube)
        for group in sorted({p["metadata"]["labels"][GROUP_LABEL] for p in mine}):
            if api is not None:
                await calls.delete_custom(kube, api, WORKLOADS, namespace, group)
        held = False
        for pod in mine:
            if FINALIZER not in (pod["metadata"].get("finalizers") or []):
                continue
            if _terminated(pod) or (pod.get("spec") or {}).get("schedulingGates"):
                # the job is gone: nothing may keep its pods, whether or not Kueue still runs
                if await calls.remove_finalizer(kube, pod, FINALIZER):
                    log.info("removed %s from %s/%s", FINALIZER, namespace, pod["metadata"]["name"])
            else:
                held = True  # still stopping: look again (the job's finalizer waits for it)
        return not held


ADAPTER = Kueue(name="kueue", crd=WORKLOAD_CRD, scheduler_name=None, podgroup_api=None)
