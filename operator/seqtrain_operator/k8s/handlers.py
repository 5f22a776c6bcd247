"""kopf wiring: the passes of every SeqTrainJob in one keyed work queue with a bounded number of workers
(k8s/workqueue.py), queued by its own, its pods' and the nodes' changes and by the delay its last pass asked for.
A kopf daemon per job says only whether this operator may act on it (peering, deletion). A pass that admits a
gang hands its creation to a task beside the passes (k8s/creations.py), so no pass waits for a gang's POSTs.

Load: pods are watched with a server-side label selector (only the operator's pods reach it), and every pass reads
its job's pods and the nodes from in-memory mirrors fed by those watches (k8s/mirror.py: every relist after a cut
watch REPLACES what they held, so an object deleted in the gap leaves no ghost; no pass runs before their first
LIST, so a fresh operator never mistakes an unfilled cache for a vanished gang) instead of LISTing them, and reads
the job itself from kopf's live body while its resourceVersion is the last one this operator knows (a GET
otherwise). The mirrors hold trimmed projections (k8s/project.py); gang admission reads free capacity from a ledger
that pod events keep (k8s/ledger.py; other tenants' pods through k8s/foreign.py's mirror), never a LIST; a job
waiting for capacity does so less often the longer it waits (node changes queue it at once).

Level-based: every pass reads the cluster and the job's status and calls the shared controller core; an event
only makes the next pass come sooner. The daemons run only in the active operator (kopf peering stops them in the
others), and kopf stops a job's daemon, which waits for the job's pass in flight, before its deletion handler runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from seqtrain.spec import API_GROUP, PLURAL, SpecError, parse_job
from seqtrain.spec.crd import drift_message, missing_fields
from seqtrain.spec.policy import job_policy_problems
from seqtrain_operator.k8s import manifests as m
from seqtrain_operator.k8s import project
from seqtrain_operator.k8s.admission import Admissions
from seqtrain_operator.k8s.busy import BusyPods
from seqtrain_operator.k8s.claims import claim_problem
from seqtrain_operator.k8s.client import Kube, load_config
from seqtrain_operator.k8s.creations import Creations
from seqtrain_operator.k8s.foreign import ForeignPods
from seqtrain_operator.k8s.ledger import Ledger
from seqtrain_operator.k8s.metrics import OperatorMetrics
from seqtrain_operator.k8s.mirror import Mirror
from seqtrain_operator.k8s.progress import authority
from seqtrain_operator.k8s.push import serve as serve_pushes
from seqtrain_operator.k8s.reconcile import Config, cleanup, reconcile
from seqtrain_operator.k8s.release import FINALIZER
from seqtrain_operator.k8s.webhookserve import GuardedWebhookServer
from seqtrain_operator.k8s.workqueue import WorkQueue

VERSION = "v1alpha1"
WEBHOOK_ID = "validate-seqtrainjob"
# The oldest kopf this operator supports (pyproject.toml's floor; a unit test keeps the two equal). kopf sends the
# job watch, its finalizer and annotation patches, kopf.event and peering through its own client, not `Kube`: only
# from 1.43.0 does that client wait what a 429's Retry-After asks (settings.networking.enforce_retry_after), and
# without it kopf retries an overloaded apiserver on its own fixed backoffs. The newest API called here is older:
# kopf.on.validate(operations=[...]) (enable_webhook), 1.37.0. The pod and node watches are ours (k8s/mirror.py),
# so kopf's label-selector setting (1.45.0) is not needed.
KOPF_FLOOR = "1.43"
log = logging.getLogger("seqtrain.operator")


@dataclass
class WebhookConfig:
    port: int = 9443
    certfile: str | None = None
    keyfile: str | None = None
    insecure: bool = False  # plain HTTP: tests only


@dataclass
class OperatorState:
    """Process-wide: configured by `main()` (or a test) before kopf starts; filled in at startup."""

    config: Config = field(default_factory=Config)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    metrics_port: int | None = None
    webhook: WebhookConfig | None = None
    kube: Kube | None = None
    api_qps: float = 200.0  # the API client's budget (client.Budget)
    api_burst: int = 400
    workers: int = 64  # passes in flight at most (k8s/workqueue.py)
    creators: int = 16  # gang creations in flight at most (k8s/creations.py)
    queue: WorkQueue | None = None
    live: dict[tuple[str, str], Any] = field(default_factory=dict)  # kopf's live body per job with a daemon
    nodes_seen: dict[str, Any] = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)  # node capacity taken, from pod events (k8s/ledger.py)
    foreign: Mirror | None = None  # other tenants' pods into the ledger (k8s/foreign.py)
    pods: Mirror | None = None  # the operator's pods (k8s/mirror.py)
    nodes: Mirror | None = None
    by_job: dict[tuple[str, str], dict[tuple[str, str], dict]] = field(default_factory=dict)  # (ns, job) -> pods
    push_server: Any = None  # aiohttp's runner of the progress push endpoint (k8s/push.py)
    poked: set[tuple[str, str]] = field(default_factory=set)  # jobs poked while their gang was being created

    def mirrors(self) -> list[Mirror]:
        return [x for x in (self.pods, self.nodes, self.foreign) if x is not None]

    def poke(self, namespace: str | None, name: str | None) -> None:
        """A pass for the job soon (ignored for a job whose daemon is not running: see `reconcile_daemon`, and while
        its gang is being created: its pods' events would only queue passes that do nothing; the creation's end
        schedules the next)."""
        key = (namespace or "", name or "")
        if self.queue is not None and not self._creating(key):
            self.queue.add(key)

    def poke_soon(self, namespace: str | None, name: str | None) -> None:
        """`poke`, batched: a pass within POD_BATCH_SECONDS, one for all the job's pod events meanwhile."""
        key = (namespace or "", name or "")
        if self.queue is not None and not self._creating(key):
            self.queue.add_after(key, POD_BATCH_SECONDS)

    def _creating(self, key: tuple[str, str]) -> bool:
        """Its gang is being created: the poke is kept for the creation's end (`_created`)."""
        if self.config.creations is None or not self.config.creations.busy(key):
            return False
        self.poked.add(key)
        return True

    def poke_all(self) -> None:
        if self.queue is not None:
            self.queue.add_all()


STATE = OperatorState()

# A job's pod events are batched: kube-controller-manager's Job controller waits the same second
# (syncJobBatchPeriod). A gang of 8 pods makes 24 pod events on its way to Running (created, bound, started); one
# pass each made the 1000-job run's passes 1.7x as many (31,800) once a pass no longer waited for its creations,
# and the extra CPU slowed everything on the two cores the operator shares with the control plane.
POD_BATCH_SECONDS = 1.0


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf keeps each object's last-handled spec (an annotation) to tell a creation from an update for on.create
    and on.update handlers. This operator has none (every pass reads the spec; deletion is told by the
    deletionTimestamp), so nothing is kept: one PATCH per job less (1000 of the 1000-job benchmark's 17,397
    requests) and no copy of the spec in every job's metadata."""

    def fetch(self, *, body: Any) -> None:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's would repeat it
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    if STATE.webhook is not None:
        w = STATE.webhook
        settings.admission.server = GuardedWebhookServer(port=w.port, certfile=w.certfile, pkeyfile=w.keyfile,
                                                         insecure=w.insecure, addr="0.0.0.0" if not w.insecure else "127.0.0.1")
    STATE.kube = Kube(load_config(), qps=STATE.api_qps, burst=STATE.api_burst)
    await warn_if_crd_is_old(STATE.kube)
    STATE.live.clear()
    STATE.queue = WorkQueue(reconcile_pass, workers=STATE.workers, on_error=_pass_failed,
                            on_depth=STATE.metrics.workqueue_depth.set)
    STATE.config.creations = Creations(STATE.creators, on_done=_created,
                                       on_seconds=STATE.metrics.gang_create_seconds.observe, on_error=_creation_failed)
    STATE.nodes_seen.clear()
    STATE.ledger = Ledger()  # before the watches start: the pod mirror fills it
    STATE.by_job.clear()
    STATE.foreign = ForeignPods(STATE.kube, STATE.ledger)
    # Server-side filtering: the apiserver sends only pods that carry the job label, not every pod in the cluster.
    STATE.pods = Mirror(STATE.kube, "pods", label_selector=m.LABEL_JOB, project=project.pod, on_upsert=pod_changed,
                        on_delete=pod_deleted, name="the operator's pods")
    STATE.nodes = Mirror(STATE.kube, "nodes", project=project.node, on_upsert=lambda n, _old: node_changed(n),
                         on_delete=lambda n: node_changed(n, deleted=True))
    views, busy = IndexViews(), STATE.config.busy
    STATE.config.admissions = Admissions(
        free=lambda: STATE.ledger.free(views.nodes(), reserved_use=busy.outstanding_use(STATE.ledger.seen, None)),
        reserve=busy.reserve, own=lambda job: [*STATE.ledger.used_by(job), *busy.outstanding_use_of(job)],
        poke=lambda job: STATE.poke(*job),
        on_wait=STATE.metrics.admission_wait_seconds.observe, on_cycle=STATE.metrics.admission_cycle_seconds.observe)
    for mirror in STATE.mirrors():
        mirror.start()
    if STATE.metrics_port:
        STATE.metrics.serve(STATE.metrics_port)
    cfg = STATE.config
    if cfg.push_port and cfg.settings.push_key:
        STATE.push_server = await serve_pushes(cfg.pushed, cfg.settings.push_key, cfg.push_port)


@kopf.on.cleanup()
async def stop_watching(**_: Any) -> None:
    if STATE.queue is not None:
        await STATE.queue.stop()
    if STATE.config.creations is not None:
        await STATE.config.creations.stop()
    if STATE.config.admissions is not None:
        await STATE.config.admissions.stop()
    for mirror in STATE.mirrors():
        await mirror.stop()
    if STATE.push_server is not None:
        await STATE.push_server.cleanup()
        STATE.push_server = None


async def warn_if_crd_is_old(kube: Kube) -> list[str]:
    """An installed CRD older than this operator prunes the fields it lacks from every job (Helm never upgrades
    crds/): say so at startup, with the fix. Returns the missing fields."""
    try:
        installed = await kube.get_crd(f"{PLURAL}.{API_GROUP}")
    except Exception as exc:  # noqa: BLE001 - a check, never a reason not to start
        log.warning("could not read the SeqTrainJob CRD to compare it with this version: %s", exc)
        return []
    missing = missing_fields(installed) if installed else []
    if missing:
        log.warning("%s", drift_message(missing))
    return missing


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account in a cluster, else the kubeconfig (read when logging in, not at import)."""
    info = kopf.login_with_service_account(**kwargs)
    if info is None:
        return kopf.login_with_kubeconfig(**kwargs)
    return dataclasses.replace(info, server=in_cluster_server(os.environ, info.server))


def in_cluster_server(env: Mapping[str, str], default: str) -> str:
    """client-go's in-cluster rule: the API server is $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, which the
    kubelet sets in every container. kopf's helper names https://kubernetes.default.svc, which needs cluster DNS:
    a pod without it (dnsPolicy Default, hostNetwork; the testbed's container nodes) never reached the API."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return default
    return f"https://{authority(host, port)}"


def _emit(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


def pod_changed(pod: dict, old: dict | None) -> None:
    """One of the operator's pods added or changed (a watch event, or a relist)."""
    meta = pod["metadata"]
    key, job = (meta.get("namespace") or "", meta["name"]), (meta.get("labels") or {}).get(m.LABEL_JOB)
    if old is not None and (old_job := (old["metadata"].get("labels") or {}).get(m.LABEL_JOB)) != job:
        STATE.by_job.get((key[0], old_job or ""), {}).pop(key, None)
    STATE.ledger.update(pod)
    if job is not None:
        STATE.by_job.setdefault((key[0], job), {})[key] = pod
    STATE.poke_soon(key[0], job)


def pod_deleted(pod: dict) -> None:
    """Deleted: its DELETED event, or absent from a relist (deleted while the watch was cut)."""
    meta = pod["metadata"]
    key, job = (meta.get("namespace") or "", meta["name"]), (meta.get("labels") or {}).get(m.LABEL_JOB)
    # an admission reservation for it (if one is left) ends: see k8s/busy.py; so does the record of its creation
    # (k8s/expect.py)
    STATE.config.busy.gone(key)
    STATE.ledger.remove(key)
    STATE.config.expected.gone(*key)
    if (pods := STATE.by_job.get((key[0], job or ""))) is not None:
        pods.pop(key, None)
        if not pods:
            del STATE.by_job[(key[0], job or "")]
    STATE.poke_soon(key[0], job)


@dataclass
class IndexViews:
    """reconcile.Views over the mirrors."""

    def pods(self, namespace: str, job: str) -> list[dict]:
        return list(STATE.by_job.get((namespace, job), {}).values())

    def all_pods(self) -> list[dict]:
        return [p for pods in STATE.by_job.values() for p in pods.values()]

    def nodes(self) -> list[dict]:
        return list(STATE.nodes.objects.values()) if STATE.nodes is not None else []

    async def free(self, job: tuple[str, str], busy: BusyPods) -> list[Any]:
        """Free capacity per node from the ledger (no LIST): allocatable less every pod's requests and the
        reservations it does not show yet."""
        return STATE.ledger.free(self.nodes(), exclude_job=job,
                                 reserved_use=busy.outstanding_use(STATE.ledger.seen, job))


async def _synced() -> None:
    """Until the first LIST of every mirror has filled it (a pass must never read an unfilled cache)."""
    for mirror in STATE.mirrors():
        await mirror.synced.wait()


@kopf.daemon(API_GROUP, VERSION, PLURAL, id="reconcile", cancellation_timeout=10.0)
async def reconcile_daemon(name: str, namespace: str, stopped: kopf.DaemonStopped, body: Any = None,
                           **_: Any) -> None:
    """Held while kopf lets this operator act on the job: not paused by peering (kopf stops every daemon of a
    paused operator) and not being deleted (kopf stops it before the deletion handler runs). The job's passes run
    in the work queue's workers (k8s/workqueue.py), not here: a daemon is all the per-job state kopf's peering and
    deletion need, while a pass in flight holds far more, and the workers bound how many are."""
    key = (namespace, name)
    assert STATE.queue is not None
    STATE.live[key] = body  # kopf's live view of the job, replaced in place on every watch event
    # Started from a handler's context, not at startup: kopf.event (the passes' Events) needs the event queue kopf
    # sets up for its handlers.
    STATE.queue.start()
    STATE.queue.activate(key)
    try:
        await stopped.wait()
    finally:
        # No pass or gang creation after this returns: the deletion handler's clean-up never races one.
        await STATE.queue.deactivate(key)
        if STATE.config.creations is not None:
            # Short: kopf cancels this daemon 10 s after stopping it. A creation cut short is finished by the next
            # operator's pass (peering), or goes with the job (its pods' ownerReference; the clean-up deletes them).
            await STATE.config.creations.wait(key, timeout=2.0)
        STATE.live.pop(key, None)
        STATE.poked.discard(key)


async def reconcile_pass(key: tuple[str, str]) -> float | None:
    """One pass of one job (a work queue item); returns the seconds until its next one (None: only an event)."""
    namespace, name = key
    await _synced()
    assert STATE.kube is not None
    if STATE.config.creations is not None and STATE.config.creations.busy(key):
        return 5.0  # nothing to do until its gang's creation ends (which schedules the next pass): not a pass
    started = time.perf_counter()
    queued: list[float] = []  # seconds the pass waited for its admission cycle (admission.py)
    try:
        views = IndexViews() if STATE.pods is not None and STATE.nodes is not None else None
        outcome = await reconcile(STATE.kube, STATE.config, namespace, name, _emit, views=views,
                                  live=STATE.live.get(key), admission_wait=queued)
    finally:
        STATE.metrics.reconcile_seconds.observe(time.perf_counter() - started - sum(queued))
    if outcome.status is not None:
        _record(namespace, name, outcome)
    # None: nothing to poll for (a finished job, an invalid spec, a job being deleted): only a change of its pods
    # or nodes, or of the job itself (its watch event pokes it), queues it again.
    return outcome.requeue


def _pass_failed(key: Any, exc: BaseException, retry_in: float) -> None:
    STATE.metrics.reconcile_errors.labels(error=type(exc).__name__).inc()
    log.warning("reconcile %s/%s failed (%s: %s); again in %.1fs", key[0], key[1], type(exc).__name__, exc,
                retry_in)


def _created(key: tuple[str, str], requeue: float | None) -> None:
    """A gang's creation ended (k8s/creations.py): the job's next pass when the creation asked."""
    if STATE.queue is None:
        return
    if STATE.queue.running(key):  # that pass saw the creation running and ends by replacing the job's timer
        STATE.poked.discard(key)
        STATE.queue.add(key)
        return
    STATE.queue.schedule(key, requeue)
    if key in STATE.poked:  # its pods (or the job) changed meanwhile: as the events would have asked
        STATE.poked.discard(key)
        STATE.queue.add_after(key, POD_BATCH_SECONDS)


def _creation_failed(key: tuple[str, str], exc: BaseException) -> None:
    STATE.metrics.reconcile_errors.labels(error=type(exc).__name__).inc()
    log.warning("creating the gang of %s/%s failed (%s: %s); its next pass creates what is absent", key[0], key[1],
                type(exc).__name__, exc)


_last_counts: dict[tuple[str, str], tuple[int, int]] = {}


def _record(namespace: str, name: str, outcome: Any) -> None:
    st = outcome.status
    STATE.metrics.job_phase(namespace, name, st.phase)
    STATE.metrics.job_status(namespace, name, st)
    prev = _last_counts.get((namespace, name))
    if prev is not None:
        STATE.metrics.restarted(st.restarts - prev[0], st.infra_restarts - prev[1])
    _last_counts[(namespace, name)] = (st.restarts, st.infra_restarts)


@kopf.on.event(API_GROUP, VERSION, PLURAL, id="spec-changed")
async def job_changed(name: str, namespace: str, body: dict[str, Any], **_: Any) -> None:
    # A spec change (suspend, an edit) wakes the job's loop at once; our own status writes do not (the status
    # already carries the generation they were computed from).
    if (body.get("metadata") or {}).get("generation") != (body.get("status") or {}).get("observedGeneration"):
        STATE.poke(namespace, name)


def _node_digest(body: dict[str, Any]) -> Any:
    status, spec = body.get("status") or {}, body.get("spec") or {}
    ready = [c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return (tuple(ready), spec.get("unschedulable"), repr(spec.get("taints")), repr(status.get("allocatable")),
            repr(sorted((body.get("metadata") or {}).get("labels", {}).items())))


def node_changed(body: dict[str, Any], deleted: bool = False) -> None:
    # Heartbeats change nodes all the time; only readiness, cordons, taints, capacity and labels matter here.
    name = body["metadata"]["name"]
    digest = None if deleted else _node_digest(body)
    if STATE.nodes_seen.get(name) != digest:
        STATE.nodes_seen[name] = digest
        STATE.poke_all()


@kopf.on.delete(API_GROUP, VERSION, PLURAL, id="cleanup")
async def job_deleted(name: str, namespace: str, **_: Any) -> None:
    assert STATE.kube is not None
    if not await cleanup(STATE.kube, namespace, name):
        # a gang scheduler still holds a pod that is stopping (Kueue's finalizer): keep the job until it is released
        raise kopf.TemporaryError("pods still stopping; releasing them again shortly", delay=2)
    STATE.metrics.job_phase(namespace, name, None)
    STATE.metrics.job_status(namespace, name, None)
    _last_counts.pop((namespace, name), None)
    STATE.config.known.pop((namespace, name), None)
    STATE.config.written.pop((namespace, name), None)
    if STATE.config.admissions is not None:
        STATE.config.admissions.done((namespace, name))
    STATE.config.expected.forget((namespace, name))
    STATE.config.busy.release_job((namespace, name))
    STATE.config.written_at.pop((namespace, name), None)
    STATE.config.pushed.forget(namespace, name)


def enable_webhook(config: WebhookConfig) -> None:
    """Serve the validating webhook. Registered only when configured: kopf refuses to run admission handlers
    without a server."""
    STATE.webhook = config
    registry = kopf.get_default_registry()
    if not any(h.id == WEBHOOK_ID for h in registry._webhooks.get_all_handlers()):
        kopf.on.validate(API_GROUP, VERSION, PLURAL, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"])(admit)


async def admit(body: dict[str, Any], operation: str | None = None, old: dict[str, Any] | None = None,
                **_: Any) -> None:
    """The webhook: `validate`, then what only the cluster can tell (the checkpoint claim's access modes)."""
    validate(body, operation, old)
    if operation == "UPDATE" and old is not None and old.get("spec") == body.get("spec"):
        return
    if (body.get("metadata") or {}).get("deletionTimestamp") or STATE.kube is None:
        return
    job = parse_job({k: body.get(k) for k in ("apiVersion", "kind", "spec")} |
                    {"metadata": {"name": (body.get("metadata") or {}).get("name") or "job"}})
    namespace = (body.get("metadata") or {}).get("namespace") or "default"
    if job.spec.checkpoint.pvc and job.spec.replicas > 1:
        claim = await STATE.kube.read("v1", "PersistentVolumeClaim", namespace, job.spec.checkpoint.pvc)
        if (problem := claim_problem(job, claim)) is not None:
            raise kopf.AdmissionError(problem, code=422)


def validate(body: dict[str, Any], operation: str | None = None, old: dict[str, Any] | None = None,
             **_: Any) -> None:
    """The admission webhook: the same validation as `seqtrain validate`, every problem in one answer.

    Updates that leave the spec unchanged (kopf's finalizer and annotation patches, labels, kubectl annotate) and
    updates of an object being deleted are always allowed: otherwise a stored job that fails today's rules (an
    older operator's object) could never lose its finalizer, hence never be deleted."""
    if operation == "UPDATE" and old is not None:
        if (body.get("metadata") or {}).get("deletionTimestamp") or (old.get("metadata") or {}).get(
                "deletionTimestamp"):
            return
        if old.get("spec") == body.get("spec"):
            return
    doc = {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    meta = doc.get("metadata") or {}
    doc["metadata"] = {"name": meta.get("name") or meta.get("generateName") or "", "namespace": meta.get("namespace")}
    try:
        job = parse_job(doc)
        if problems := job_policy_problems(job.spec, STATE.config.settings.pod_policy, job.name):
            raise SpecError(problems)
    except SpecError as err:
        raise kopf.AdmissionError("; ".join(str(p) for p in err.problems), code=422) from None
