"""kopf wiring: the passes of every SeqTrainJob in one keyed work queue with a bounded number of workers
(k8s/passes/workqueue.py), queued by its own, its pods' and the nodes' changes and by the delay its last pass asked for.
A kopf daemon per job says only whether this operator may act on it (peering, deletion). A pass that admits a
gang hands its creation to a task beside the passes (k8s/passes/creations.py), so no pass waits for a gang's POSTs.

Load: pods are watched with a server-side label selector (only the operator's pods reach it), and every pass reads
its job's pods and the nodes from in-memory mirrors fed by those watches (k8s/cache/mirror.py: every relist after a cut
watch REPLACES what they held, so an object deleted in the gap leaves no ghost; no pass runs before their first
LIST, so a fresh operator never mistakes an unfilled cache for a vanished gang) instead of LISTing them, and reads
the job itself from kopf's live body while its resourceVersion is the last one this operator knows (a GET
otherwise). The mirrors hold trimmed projections (k8s/cache/project.py); gang admission reads free capacity from a
ledger that pod events keep (k8s/capacity/ledger.py; other tenants' pods through k8s/capacity/foreign.py's mirror),
never a LIST; a job waiting for capacity does so less often the longer it waits (node changes queue it at once).

Level-based: every pass reads the cluster and the job's status and calls the shared controller core; an event
only makes the next pass come sooner. The daemons run only in the active operator (kopf peering stops them in the
others), and kopf stops a job's daemon, which waits for the job's pass in flight, before its deletion handler runs.

State: none here. Everything the operator holds lives in one `Runtime` (k8s/process/runtime.py) that `main()` makes and
hands to kopf as its memo; every handler reads it as `memo.runtime`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from seqtrain.spec import API_GROUP, PLURAL, SpecError, parse_job
from seqtrain.spec.crd import drift_message, missing_fields
from seqtrain.spec.policy import PodPolicy, job_policy_problems
from seqtrain_operator.k8s.api.client import Kube, load_config
from seqtrain_operator.k8s.api.finalizers import FINALIZER
from seqtrain_operator.k8s.passes.reconcile import cleanup
from seqtrain_operator.k8s.process.runtime import Runtime
from seqtrain_operator.k8s.progress.poll import authority
from seqtrain_operator.k8s.webhook.claims import claim_problem
from seqtrain_operator.k8s.webhook.server import GuardedWebhookServer

VERSION = "v1alpha1"
WEBHOOK_ID = "validate-seqtrainjob"
# The oldest kopf this operator supports (pyproject.toml's floor; a unit test keeps the two equal). kopf sends the
# job watch, its finalizer and annotation patches, kopf.event and peering through its own client, not `Kube`: only
# from 1.43.0 does that client wait what a 429's Retry-After asks (settings.networking.enforce_retry_after), and
# without it kopf retries an overloaded apiserver on its own fixed backoffs. The newest API called here is older:
# kopf.on.validate(operations=[...]) (enable_webhook), 1.37.0. The pod and node watches are ours (k8s/cache/mirror.py),
# so kopf's label-selector setting (1.45.0) is not needed.
KOPF_FLOOR = "1.43"
log = logging.getLogger("seqtrain.operator")


def memo_of(runtime: Runtime) -> kopf.Memo:
    """What `kopf.run`/`kopf.operator` take as `memo=`: every handler finds the runtime there."""
    return kopf.Memo(runtime=runtime)


def _runtime(memo: Any) -> Runtime:
    rt = getattr(memo, "runtime", None)
    if not isinstance(rt, Runtime):
        raise RuntimeError("kopf was started without the operator's memo: pass memo=handlers.memo_of(Runtime(...))")
    return rt


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
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    rt = _runtime(memo)
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's would repeat it
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    if (w := rt.settings.webhook) is not None:
        settings.admission.server = GuardedWebhookServer(port=w.port, certfile=w.certfile, pkeyfile=w.keyfile,
                                                         insecure=w.insecure,
                                                         addr="0.0.0.0" if not w.insecure else "127.0.0.1")
    kube = Kube(load_config(), qps=rt.settings.api_qps, burst=rt.settings.api_burst)
    await warn_if_crd_is_old(kube)
    rt.emit = _emit
    await rt.start(kube)


@kopf.on.cleanup()
async def stop_watching(memo: Any, **_: Any) -> None:
    await _runtime(memo).stop()


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


@kopf.daemon(API_GROUP, VERSION, PLURAL, id="reconcile", cancellation_timeout=10.0)
async def reconcile_daemon(name: str, namespace: str, stopped: kopf.DaemonStopped, memo: Any, body: Any = None,
                           **_: Any) -> None:
    """Held while kopf lets this operator act on the job: not paused by peering (kopf stops every daemon of a
    paused operator) and not being deleted (kopf stops it before the deletion handler runs). The job's passes run
    in the work queue's workers (k8s/passes/workqueue.py), not here: a daemon is all the per-job state kopf's peering
    and deletion need, while a pass in flight holds far more, and the workers bound how many are."""
    rt, key = _runtime(memo), (namespace, name)
    assert rt.queue is not None and rt.reconciler is not None
    mem = rt.memory(namespace, name, (body.get("metadata") or {}).get("uid") or "")
    mem.live = body  # kopf's live view of the job, replaced in place on every watch event
    # Started from a handler's context, not at startup: kopf.event (the passes' Events) needs the event queue kopf
    # sets up for its handlers.
    rt.queue.start()
    rt.queue.activate(key)
    try:
        await stopped.wait()
    finally:
        # No pass or gang creation after this returns: the deletion handler's clean-up never races one.
        await rt.queue.deactivate(key)
        if rt.reconciler.creations is not None:
            # Short: kopf cancels this daemon 10 s after stopping it. A creation cut short is finished by the next
            # operator's pass (peering), or goes with the job (its pods' ownerReference; the clean-up deletes them).
            await rt.reconciler.creations.wait(key, timeout=2.0)
        mem.live, mem.poked = None, False


@kopf.on.event(API_GROUP, VERSION, PLURAL, id="spec-changed")
async def job_changed(name: str, namespace: str, body: dict[str, Any], memo: Any, **_: Any) -> None:
    # A spec change (suspend, an edit) wakes the job's loop at once; our own status writes do not (the status
    # already carries the generation they were computed from).
    if (body.get("metadata") or {}).get("generation") != (body.get("status") or {}).get("observedGeneration"):
        _runtime(memo).poke(namespace, name)


@kopf.on.delete(API_GROUP, VERSION, PLURAL, id="cleanup")
async def job_deleted(name: str, namespace: str, body: dict[str, Any], memo: Any, **_: Any) -> None:
    rt = _runtime(memo)
    assert rt.kube is not None
    if not await cleanup(rt.kube, namespace, name):
        # a gang scheduler still holds a pod that is stopping (Kueue's finalizer): keep the job until it is released
        raise kopf.TemporaryError("pods still stopping; releasing them again shortly", delay=2)
    rt.forget((body.get("metadata") or {}).get("uid") or "")


def enable_webhook() -> None:
    """Serve the validating webhook (Settings.webhook says where). Registered only when configured: kopf refuses to
    run admission handlers without a server."""
    registry = kopf.get_default_registry()
    if not any(h.id == WEBHOOK_ID for h in registry._webhooks.get_all_handlers()):
        kopf.on.validate(API_GROUP, VERSION, PLURAL, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"])(admit)


async def admit(body: dict[str, Any], operation: str | None = None, old: dict[str, Any] | None = None,
                memo: Any = None, **_: Any) -> None:
    """The webhook: `validate`, then what only the cluster can tell (the checkpoint claim's access modes)."""
    validate(body, operation, old, memo)
    kube = getattr(getattr(memo, "runtime", None), "kube", None)
    if operation == "UPDATE" and old is not None and old.get("spec") == body.get("spec"):
        return
    if (body.get("metadata") or {}).get("deletionTimestamp") or kube is None:
        return
    job = parse_job({k: body.get(k) for k in ("apiVersion", "kind", "spec")} |
                    {"metadata": {"name": (body.get("metadata") or {}).get("name") or "job"}})
    namespace = (body.get("metadata") or {}).get("namespace") or "default"
    if job.spec.checkpoint.pvc and job.spec.replicas > 1:
        claim = await kube.read("v1", "PersistentVolumeClaim", namespace, job.spec.checkpoint.pvc)
        if (problem := claim_problem(job, claim)) is not None:
            raise kopf.AdmissionError(problem, code=422)


def validate(body: dict[str, Any], operation: str | None = None, old: dict[str, Any] | None = None,
             memo: Any = None, **_: Any) -> None:
    """The admission webhook: the same validation as `seqtrain validate`, every problem in one answer; the pod
    policy is the runtime's (`memo.runtime`; the default policy without one, as in a test).

    Updates that leave the spec unchanged (kopf's finalizer and annotation patches, labels, kubectl annotate) and
    updates of an object being deleted are always allowed: otherwise a stored job that fails today's rules (an
    older operator's object) could never lose its finalizer, hence never be deleted."""
    if operation == "UPDATE" and old is not None:
        if (body.get("metadata") or {}).get("deletionTimestamp") or (old.get("metadata") or {}).get(
                "deletionTimestamp"):
            return
        if old.get("spec") == body.get("spec"):
            return
    rt = getattr(memo, "runtime", None)
    policy = rt.settings.pods.pod_policy if isinstance(rt, Runtime) else PodPolicy()
    doc = {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    meta = doc.get("metadata") or {}
    doc["metadata"] = {"name": meta.get("name") or meta.get("generateName") or "", "namespace": meta.get("namespace")}
    try:
        job = parse_job(doc)
        if problems := job_policy_problems(job.spec, policy, job.name):
            raise SpecError(problems)
    except SpecError as err:
        raise kopf.AdmissionError("; ".join(str(p) for p in err.problems), code=422) from None
