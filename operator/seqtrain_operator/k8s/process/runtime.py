"""The operator process: every process-wide object in one `Runtime`, made by `main()` (or a test) from the frozen
Settings and handed to kopf as its memo (handlers.py reads it from there, never from a module global).

It holds the Reconciler (what the passes share, each job's memory among it), the work queue of passes
(k8s/passes/workqueue.py), the mirrors of the operator's pods, of the nodes and of other tenants' pods
(k8s/cache/mirror.py) with the capacity ledger they feed (k8s/capacity/ledger.py), the metrics and the progress push
server. The mirrors' events queue passes; a pass reads its job's pods and the nodes from the mirrors (`views`), never a
LIST.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from seqtrain_operator.k8s.api.client import Kube
from seqtrain_operator.k8s.cache import project
from seqtrain_operator.k8s.cache.memory import JobMemory
from seqtrain_operator.k8s.cache.mirror import Mirror
from seqtrain_operator.k8s.capacity.admission import Admissions
from seqtrain_operator.k8s.capacity.busy import BusyPods
from seqtrain_operator.k8s.capacity.foreign import ForeignPods
from seqtrain_operator.k8s.capacity.ledger import Ledger
from seqtrain_operator.k8s.owner import owner_uid
from seqtrain_operator.k8s.passes.creations import Creations
from seqtrain_operator.k8s.passes.reconcile import EventSink, Reconciler
from seqtrain_operator.k8s.passes.workqueue import WorkQueue
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.process.metrics import OperatorMetrics
from seqtrain_operator.k8s.progress.push import serve as serve_pushes
from seqtrain_operator.k8s.settings import Settings

log = logging.getLogger("seqtrain.operator")
Key = tuple[str, str]  # (namespace, name)

# A job's pod events are batched: kube-controller-manager's Job controller waits the same second
# (syncJobBatchPeriod). A gang of 8 pods makes 24 pod events on its way to Running (created, bound, started): one
# pass for all of them, not one each.
POD_BATCH_SECONDS = 1.0


@dataclass(eq=False)
class Runtime:
    settings: Settings = field(default_factory=Settings)
    emit: EventSink = lambda body, type_, reason, message: None  # the passes' Events (handlers: kopf.event)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    reconciler: Reconciler | None = None  # made by `start`, with the API client
    queue: WorkQueue | None = None
    ledger: Ledger = field(default_factory=Ledger)  # node capacity taken, from pod events
    pods: Mirror | None = None  # the operator's pods
    nodes: Mirror | None = None
    foreign: Mirror | None = None  # other tenants' pods, into the ledger
    by_job: dict[Key, dict[Key, dict]] = field(default_factory=dict)  # (ns, job) -> its pods in the mirror
    nodes_seen: dict[str, Any] = field(default_factory=dict)  # node -> what of it a pass reads (`node_changed`)
    push_server: Any = None  # the progress push endpoint (k8s/progress/push.py)

    @property
    def kube(self) -> Kube | None:
        return self.reconciler.kube if self.reconciler is not None else None

    # ---- life cycle --------------------------------------------------------------------------------------------

    async def start(self, kube: Kube) -> None:
        """Make the queue, the creations, the admission cycles and the mirrors around the API client, and start the
        mirrors' watches."""
        s = self.settings
        self.queue = WorkQueue(self.run_pass, workers=s.workers, on_error=self._pass_failed,
                               on_depth=self.metrics.workqueue_depth.set)
        creations = Creations(s.creators, on_done=self._created, on_seconds=self.metrics.gang_create_seconds.observe,
                              on_error=self._creation_failed)
        busy = BusyPods()
        self.nodes_seen.clear()
        self.by_job.clear()
        self.ledger = Ledger()  # before the watches start: the pod mirror fills it
        admissions = Admissions(
            free=lambda: self.ledger.free(self.node_list(), reserved_use=busy.outstanding_use(self.ledger.seen, None)),
            reserve=busy.reserve, own=lambda job: [*self.ledger.used_by(job), *busy.outstanding_use_of(job)],
            poke=lambda job: self.poke(*job), on_wait=self.metrics.admission_wait_seconds.observe,
            on_cycle=self.metrics.admission_cycle_seconds.observe)
        self.reconciler = Reconciler(kube, s, busy=busy, admissions=admissions, creations=creations)
        self.foreign = ForeignPods(kube, self.ledger)
        # Server-side filtering: the apiserver sends only pods that carry the job label, not every pod in the cluster.
        self.pods = Mirror(kube, "pods", label_selector=m.LABEL_JOB, project=project.pod, on_upsert=self.pod_changed,
                           on_delete=self.pod_deleted, name="the operator's pods")
        self.nodes = Mirror(kube, "nodes", project=project.node, on_upsert=lambda n, _old: self.node_changed(n),
                            on_delete=lambda n: self.node_changed(n, deleted=True))
        for mirror in self.mirrors():
            mirror.start()
        if s.metrics_port:
            self.metrics.serve(s.metrics_port)
        if s.push_port and s.pods.push_key:
            self.push_server = await serve_pushes(self.reconciler.pushed, s.pods.push_key, s.push_port)

    async def stop(self) -> None:
        if self.queue is not None:
            await self.queue.stop()
        r = self.reconciler
        if r is not None and r.creations is not None:
            await r.creations.stop()
        if r is not None and r.admissions is not None:
            await r.admissions.stop()
        for mirror in self.mirrors():
            await mirror.stop()
        if self.push_server is not None:
            await self.push_server.cleanup()
            self.push_server = None

    def mirrors(self) -> list[Mirror]:
        return [x for x in (self.pods, self.nodes, self.foreign) if x is not None]

    async def synced(self) -> None:
        """Until the first LIST of every mirror has filled it (a pass must never read an unfilled cache)."""
        for mirror in self.mirrors():
            await mirror.synced.wait()

    # ---- jobs ----------------------------------------------------------------------------------------------------

    def memory(self, namespace: str, name: str, uid: str) -> JobMemory:
        """The job's memory, made on first sight (its daemon's start)."""
        assert self.reconciler is not None
        return self.reconciler.jobs.seen(namespace, name, uid)

    def forget(self, uid: str) -> None:
        """The job incarnation `uid` was deleted: everything this operator remembers of it goes (one call)."""
        if self.reconciler is None or (mem := self.reconciler.forget(uid)) is None:
            return
        if self.reconciler.jobs.get(*mem.key) is None:  # no namesake took the name (its series are its own)
            self.metrics.job_phase(mem.namespace, mem.name, None)
            self.metrics.job_status(mem.namespace, mem.name, None)

    async def run_pass(self, key: Key) -> float | None:
        """One pass of one job (a work queue item); returns the seconds until its next one (None: only an event)."""
        namespace, name = key
        await self.synced()
        r = self.reconciler
        assert r is not None
        if r.creations is not None and r.creations.busy(key):
            return 5.0  # nothing to do until its gang's creation ends (which schedules the next pass): not a pass
        started = time.perf_counter()
        queued: list[float] = []  # seconds the pass waited for its admission cycle (admission.py)
        try:
            outcome = await r.reconcile(namespace, name, self.emit, MirrorViews(self), admission_wait=queued)
        finally:
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started - sum(queued))
        if outcome.status is not None and (mem := r.jobs.get(namespace, name)) is not None:
            self._record(mem, outcome.status)
        # None: nothing to poll for (a finished job, an invalid spec, a job being deleted): only a change of its pods
        # or nodes, or of the job itself (its watch event pokes it), queues it again.
        return outcome.requeue

    def _record(self, mem: JobMemory, st: Any) -> None:
        self.metrics.job_phase(mem.namespace, mem.name, st.phase)
        self.metrics.job_status(mem.namespace, mem.name, st)
        if mem.restarts is not None:
            self.metrics.restarted(st.restarts - mem.restarts[0], st.infra_restarts - mem.restarts[1])
        mem.restarts = (st.restarts, st.infra_restarts)

    def _pass_failed(self, key: Any, exc: BaseException, retry_in: float) -> None:
        self.metrics.reconcile_errors.labels(error=type(exc).__name__).inc()
        log.warning("reconcile %s/%s failed (%s: %s); again in %.1fs", key[0], key[1], type(exc).__name__, exc,
                    retry_in)

    def _created(self, key: Key, requeue: float | None) -> None:
        """A gang's creation ended (k8s/passes/creations.py): the job's next pass when the creation asked."""
        if self.queue is None:
            return
        mem = self.reconciler.jobs.get(*key) if self.reconciler is not None else None
        poked = mem is not None and mem.poked
        if mem is not None:
            mem.poked = False
        if self.queue.running(key):  # that pass saw the creation running and ends by replacing the job's timer
            self.queue.add(key)
            return
        self.queue.schedule(key, requeue)
        if poked:  # its pods (or the job) changed meanwhile: as the events would have asked
            self.queue.add_after(key, POD_BATCH_SECONDS)

    def _creation_failed(self, key: Key, exc: BaseException) -> None:
        self.metrics.reconcile_errors.labels(error=type(exc).__name__).inc()
        log.warning("creating the gang of %s/%s failed (%s: %s); its next pass creates what is absent", key[0],
                    key[1], type(exc).__name__, exc)

    # ---- pokes -----------------------------------------------------------------------------------------------------

    def poke(self, namespace: str | None, name: str | None) -> None:
        """A pass for the job soon (ignored for a job whose daemon is not running, and while its gang is being
        created: its pods' events would only queue passes that do nothing; the creation's end schedules the next)."""
        key = (namespace or "", name or "")
        if self.queue is not None and not self._creating(key):
            self.queue.add(key)

    def poke_soon(self, namespace: str | None, name: str | None) -> None:
        """`poke`, batched: a pass within POD_BATCH_SECONDS, one for all the job's pod events meanwhile."""
        key = (namespace or "", name or "")
        if self.queue is not None and not self._creating(key):
            self.queue.add_after(key, POD_BATCH_SECONDS)

    def _creating(self, key: Key) -> bool:
        """Its gang is being created: the poke is kept for the creation's end (`_created`)."""
        r = self.reconciler
        if r is None or r.creations is None or not r.creations.busy(key):
            return False
        if (mem := r.jobs.get(*key)) is not None:
            mem.poked = True
        return True

    def poke_all(self) -> None:
        if self.queue is not None:
            self.queue.add_all()

    # ---- the mirrors' events ---------------------------------------------------------------------------------------

    def pod_changed(self, pod: dict, old: dict | None) -> None:
        """One of the operator's pods added or changed (a watch event, or a relist)."""
        meta = pod["metadata"]
        key, job = (meta.get("namespace") or "", meta["name"]), (meta.get("labels") or {}).get(m.LABEL_JOB)
        if old is not None and (old_job := (old["metadata"].get("labels") or {}).get(m.LABEL_JOB)) != job:
            self.by_job.get((key[0], old_job or ""), {}).pop(key, None)
        self.ledger.update(pod)
        if job is not None:
            self.by_job.setdefault((key[0], job), {})[key] = pod
        self.poke_soon(key[0], job)

    def pod_deleted(self, pod: dict) -> None:
        """Deleted: its DELETED event, or absent from a relist (deleted while the watch was cut). Its admission
        reservation (if one is left) ends, and so does the record of its creation (k8s/cache/expect.py)."""
        meta = pod["metadata"]
        key, job = (meta.get("namespace") or "", meta["name"]), (meta.get("labels") or {}).get(m.LABEL_JOB)
        self.ledger.remove(key)
        if (r := self.reconciler) is not None:
            r.busy.gone(key)
            mem = r.jobs.of_uid(owner_uid(pod)) or r.jobs.get(key[0], job or "")
            if mem is not None:
                mem.expected.gone(key[1])
        if (pods := self.by_job.get((key[0], job or ""))) is not None:
            pods.pop(key, None)
            if not pods:
                del self.by_job[(key[0], job or "")]
        self.poke_soon(key[0], job)

    def node_changed(self, body: dict[str, Any], deleted: bool = False) -> None:
        """Heartbeats change nodes all the time; only readiness, cordons, taints, capacity and labels matter here."""
        name = body["metadata"]["name"]
        digest = None if deleted else _node_digest(body)
        if self.nodes_seen.get(name) != digest:
            self.nodes_seen[name] = digest
            self.poke_all()

    def node_list(self) -> list[dict]:
        return list(self.nodes.objects.values()) if self.nodes is not None else []


def _node_digest(body: dict[str, Any]) -> Any:
    status, spec = body.get("status") or {}, body.get("spec") or {}
    ready = [c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return (tuple(ready), spec.get("unschedulable"), repr(spec.get("taints")), repr(status.get("allocatable")),
            repr(sorted((body.get("metadata") or {}).get("labels", {}).items())))


@dataclass(eq=False)
class MirrorViews:
    """reconcile.Views over the runtime's mirrors."""

    rt: Runtime

    def pods(self, namespace: str, job: str) -> list[dict]:
        return list(self.rt.by_job.get((namespace, job), {}).values())

    def all_pods(self) -> list[dict]:
        return [p for pods in self.rt.by_job.values() for p in pods.values()]

    def nodes(self) -> list[dict]:
        return self.rt.node_list()

    async def free(self, job: Key, busy: BusyPods) -> list[Any]:
        """Free capacity per node from the ledger (no LIST): allocatable less every pod's requests and the
        reservations it does not show yet."""
        return self.rt.ledger.free(self.nodes(), exclude_job=job,
                                   reserved_use=busy.outstanding_use(self.rt.ledger.seen, job))
