"""One reconcile pass of one SeqTrainJob, in stages (read -> decide -> write status -> act -> events).

1. Read the job, its pods and the nodes from the API server (level-based: nothing is remembered in memory, so
   an operator restarted mid-job continues from exactly what the cluster and the job's status say).
2. Observe: pods -> ReplicaObservation, rank 0's progress; when no gang exists, gang admission: the native
   placement over free node capacity, or the presence of the external gang scheduler.
3. Decide with the shared controller core (`seqtrain_operator.controller.decide`), the same as local runs.
4. Write the status, with the job's resourceVersion as an optimistic lock: on 409 nothing was done and the pass
   is repeated on fresh data. Writing it BEFORE acting means a crash between the two never forgets a gang it
   created: the status already names the attempt, and the core re-creates whatever of it is absent.
5. Act: delete gangs (pods, ConfigMap, PodGroup of that attempt), create the gang (create-if-absent, so a repeat
   never duplicates anything: names are deterministic per attempt). In the operator, a decision that creates a
   gang is acted on in a creation task beside the passes (k8s/creations.py), not in the pass.
6. Emit the decision's Kubernetes Events, only after the status write succeeded (and the gang was created).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

from kubernetes.client.rest import ApiException

from seqtrain.spec import JobStatus, SeqTrainJob, SpecError, parse_job
from seqtrain.spec.policy import job_policy_problems
from seqtrain.spec.problems import Problem
from seqtrain.spec.runtime import FailureHistory
from seqtrain.spec.status import TERMINAL_PHASES
from seqtrain_operator.controller import (
    CreateGang,
    DeleteGang,
    DeleteJob,
    Event,
    Observed,
    ReplicaObservation,
    RequeueAfter,
    create_failed,
    decide,
    parse,
    utcnow,
)
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller.checkpoint_policy import failure_history, priority_boost
from seqtrain_operator.controller.types import Decision
from seqtrain_operator.k8s import calls, project
from seqtrain_operator.k8s import manifests as m
from seqtrain_operator.k8s.admission import PRIORITY_TTL_SECONDS, Admissions
from seqtrain_operator.k8s.busy import BusyPods
from seqtrain_operator.k8s.client import Conflict, Kube, NameTaken, api_message
from seqtrain_operator.k8s.creations import Creations
from seqtrain_operator.k8s.expect import Expectations
from seqtrain_operator.k8s.gangs import ADAPTERS, GangScheduler, adapter_for
from seqtrain_operator.k8s.observe import (
    TERMINATION_OVERDUE_SECONDS,
    Reported,
    awaiting_scheduler,
    final_progress,
    observe_replicas,
    rank0_ip,
)
from seqtrain_operator.k8s.owner import owned_by
from seqtrain_operator.k8s.progress import poll_progress, progress_url
from seqtrain_operator.k8s.push import PushedProgress
from seqtrain_operator.k8s.release import FINALIZER
from seqtrain_operator.planner.inventory import inventory
from seqtrain_operator.planner.types import Node, Plan

log = logging.getLogger("seqtrain.operator")

EventSink = Callable[[dict[str, Any], str, str, str], None]


@dataclass
class Config:
    settings: m.Settings = field(default_factory=m.Settings)
    node_lost_grace: float = 40.0  # a node NotReady this long counts as lost for its pods
    # a pod Terminating this long past its grace period on a Ready node is force-deleted (observe.replica_of)
    termination_overdue: float = TERMINATION_OVERDUE_SECONDS
    running_poll: float = 10.0  # look again this often while a gang runs (progress, hangs)
    idle_poll: float = 60.0  # and this often otherwise (events wake the loop sooner)
    progress_timeout: float = 2.0
    poll_progress: bool = True
    busy: BusyPods = field(default_factory=BusyPods)  # admission's view of the cluster's pods (state, not a knob)
    # (namespace, name) -> the job's resourceVersion this operator last read or wrote (state, not a knob): a pass
    # whose watch-fed body has it reads no GET (see `_read_job`)
    known: dict[tuple[str, str], str] = field(default_factory=dict)
    # (namespace, name) -> (the version our last status write replaced, what the write returned), until the watch
    # shows that write (state, not a knob; see `_read_job`)
    written: dict[tuple[str, str], tuple[str, dict[str, Any]]] = field(default_factory=dict)
    # Progress alone (the step moving on) is written at most this often per job; a phase, a condition or a
    # checkpoint at once (with the progress of the moment). 1000 running jobs polled every 10 s would otherwise
    # cost 100 status writes a second.
    progress_interval: float = 30.0
    # (namespace, name) -> time.monotonic() of this operator's last status write (state, not a knob)
    written_at: dict[tuple[str, str], float] = field(default_factory=dict)
    # the pods this operator created per job and attempt, until its cache shows them (state: see k8s/expect.py)
    expected: Expectations = field(default_factory=Expectations)
    # Progress pushed by rank 0 (k8s/push.py): served on this port (None: not served), used while it is at most
    # `push_fresh` seconds old (rank 0 repeats it every few seconds), else the pass polls.
    push_port: int | None = None
    push_fresh: float = 30.0
    pushed: PushedProgress = field(default_factory=PushedProgress)  # (state, not a knob)
    # Native admission in cycles for every waiting gang (k8s/admission.py; None: one gang at a time under a lock,
    # for a pass without the operator's caches). State, not a knob.
    admissions: Admissions | None = None
    # PriorityClass name -> (value, time.monotonic() read): the admission order (state, not a knob)
    priorities: dict[str, tuple[int, float]] = field(default_factory=dict)
    # Gang creations beside the passes (k8s/creations.py; None: inside the pass, for a pass without the operator's
    # work queue). State, not a knob.
    creations: Creations | None = None


@dataclass
class Outcome:
    requeue: float | None  # seconds until the next pass; None: the job is gone
    status: JobStatus | None = None
    events: tuple[Event, ...] = ()


def _job_from(body: dict[str, Any]) -> SeqTrainJob:
    doc = {k: body[k] for k in ("apiVersion", "kind", "spec") if k in body}
    meta = body.get("metadata") or {}
    doc["metadata"] = {"name": meta.get("name"), "namespace": meta.get("namespace")}
    return parse_job(doc)


async def admission(kube: Kube, job: SeqTrainJob) -> str | None:
    """Why an external gang scheduler cannot take the gang (None: it can). Native gangs are admitted by the core
    from Observed.capacity."""
    gang = job.spec.scheduling.gang
    adapter = adapter_for(gang)
    assert adapter is not None, gang  # the spec admits only the gangs that have an adapter
    if (problem := adapter.config_problem(job)) is not None:
        return problem
    if not await kube.crd_exists(adapter.crd):
        return (f"scheduling.gang is {gang}, but {gang} is not installed in this cluster (no CustomResourceDefinition "
                f"{adapter.crd}); install it or use gang: native")
    return None


async def capacity(kube: Kube, nodes: list[dict], busy: BusyPods, job: tuple[str, str],
                   ours: list[dict] | None = None) -> tuple[Node, ...]:
    """Free capacity per node: allocatable minus the requests of every non-terminated pod bound or pinned to it,
    cluster-wide (what kube-scheduler subtracts too; pods created but not bound yet, and reserved ones, included).
    `ours`: this operator's pods from its index (None: LIST them too)."""
    return tuple(inventory(nodes, await busy.current(kube, job, ours)))


async def _free(kube: Kube, cfg: Config, views: Views | None, nodes: list[dict],
                job: tuple[str, str]) -> tuple[Node, ...]:
    """`capacity` from the indexes as they are now (without them: `nodes` and a LIST). Read at the moment of the
    decision, not at the start of the pass: queued behind hundreds of admissions a pass waits minutes for the lock,
    and gangs created meanwhile (their reservations ended when the index showed them) are missing from an earlier
    snapshot (the 1000-job run pinned up to 4x a node's CPUs)."""
    if views is None:
        return await capacity(kube, nodes, cfg.busy, job)
    if (free := getattr(views, "free", None)) is not None:  # the operator's capacity ledger (k8s/ledger.py)
        return tuple(await free(job, cfg.busy))
    return await capacity(kube, views.nodes(), cfg.busy, job, views.all_pods())


# One admission decision at a time in this operator: two jobs planned concurrently would both see the same free
# GPUs. Held from reading the capacity until the planned pods are reserved in `Config.busy`; the status write and
# the creations happen after, while the next job is planned around the reservation.
_ADMISSION = asyncio.Lock()


STALE = ""  # in Config.known: our last write conflicted; the next pass GETs the job


def _status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) turning `old` into `new`: vanished keys are nulled at every depth."""
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict):
            patch[k] = _status_patch(old[k], v)
        else:
            patch[k] = v
    return patch


# Figures that move on every pass while a gang runs (goodput and the lost-time accounting behind it).
_DRIFT = ("goodput", "productiveSeconds", "lostSeconds", "timeLedger")


def _changed(old: dict[str, Any], new: dict[str, Any], coalesce_progress: bool = False) -> bool:
    """Whether the status is worth a write: goodput alone drifts every pass while a gang runs; it rides along with
    the next real change (progress, a condition, a phase) instead of costing one API write per job per pass.
    `coalesce_progress`: progress too (a step count moving on) waits for the next write (see Config)."""
    drift = _DRIFT + ("progress",) if coalesce_progress else _DRIFT
    return {k: v for k, v in new.items() if k not in drift} != {k: v for k, v in old.items() if k not in drift}


class Views(Protocol):
    """Where a pass reads its job's pods and the nodes: the operator's in-memory mirrors (k8s/mirror.py; no LIST per
    pass)."""

    def pods(self, namespace: str, job: str) -> list[dict]: ...

    def all_pods(self) -> list[dict]: ...

    def nodes(self) -> list[dict]: ...


async def _read_job(kube: Kube, cfg: Config, namespace: str, name: str,
                    live: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The job as of the newest version this operator knows, without a GET where it can tell:
    - the watch-fed body (kopf's live view) the first time (nothing newer is known), and when its resourceVersion is
      the one this operator last read or wrote;
    - what our last status write returned while the watch still shows the version that write replaced;
    - the watch-fed body when it carries the status we last wrote (only metadata moved on since: kopf's finalizer
      and annotation patches).
    Otherwise (someone else changed the job, or our last write conflicted) a GET. The 300-job benchmark made 4.6 GETs per job, one after nearly
    every status write. A stale read is caught by the optimistic lock of the status write, as with a GET."""
    key = (namespace, name)
    rv = ((live or {}).get("metadata") or {}).get("resourceVersion")
    written = cfg.written.get(key)
    if live is not None and rv is not None and key not in cfg.known:  # first sight: nothing newer is known
        return project.job(live)
    if rv is not None and rv == cfg.known.get(key):
        cfg.written.pop(key, None)
        return project.job(live)  # type: ignore[arg-type]
    if written is not None and rv is not None:
        if rv == written[0]:  # the watch has not shown our write yet
            return project.job(written[1])
        if live is not None and live.get("status") == written[1].get("status") and \
                (live.get("metadata") or {}).get("generation") == written[1]["metadata"].get("generation"):
            cfg.known[key] = rv
            cfg.written.pop(key, None)
            return project.job(live)
    cfg.written.pop(key, None)
    body = await kube.get_job(namespace, name)
    body = project.job(body) if body is not None else None
    if body is None:
        cfg.known.pop(key, None)
    else:
        cfg.known[key] = body["metadata"]["resourceVersion"]
    return body


async def reconcile(kube: Kube, cfg: Config, namespace: str, name: str, emit: EventSink,
                    now: datetime | None = None, views: Views | None = None,
                    live: Mapping[str, Any] | None = None, admission_wait: list[float] | None = None) -> Outcome:
    """One pass. `live`: the job's body as the watch last delivered it (None: GET it). `admission_wait`: told the
    seconds the pass waited for its admission cycle (queueing, not the pass's own work)."""
    admission_wait = admission_wait if admission_wait is not None else []
    if cfg.creations is not None and cfg.creations.busy((namespace, name)):
        # its gang is being created: the creation's end schedules the next pass (this timer is a backstop)
        return Outcome(requeue=5.0)
    now = now or utcnow()
    body = await _read_job(kube, cfg, namespace, name, live)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        cfg.known.pop((namespace, name), None)
        cfg.written.pop((namespace, name), None)
        return Outcome(requeue=None)
    old_status = dict(body.get("status") or {})
    if live is not None and (settling := _kopf_settling(body, now)) is not None:
        if settling:
            # A new job: kopf is adding its finalizer, then its annotations. Writing the status now races those
            # PATCHes (a 409 for one of the two, then a GET and a retry: 7 of 20 jobs in the benchmark); their
            # watch events wake us.
            return Outcome(requeue=1.0, status=JobStatus.model_validate(old_status))
        # kopf's patches are late (an operator behind on its events: the 1000-job run) or never come: read the job
        # rather than write over a body the watch may not have updated (474 of 1000 jobs answered 409 so).
        cfg.known[(namespace, name)] = STALE
        body = await _read_job(kube, cfg, namespace, name, live)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return Outcome(requeue=None)
        old_status = dict(body.get("status") or {})
    status = JobStatus.model_validate(old_status)
    try:
        job = _job_from(body)
    except SpecError as err:
        return await _invalid(kube, body, status, err, emit, now)

    if views is not None:
        pods, nodes = views.pods(namespace, name), views.nodes()
    else:  # no indexes (a one-off pass): read the API
        pods, nodes = await kube.list_pods(namespace, f"{m.LABEL_JOB}={name}"), await kube.list_nodes()
    if views is not None and not pods and _cache_behind(cfg, body, status):
        # Our own creations are not in the cache yet: nothing to decide on until they are (their events wake the
        # job). Deciding now would take the admission path for a gang that exists (the 300-job run spent the
        # operator's CPU there while kopf fell minutes behind the pod events).
        return Outcome(requeue=cfg.idle_poll, status=status)
    # A job re-applied under a deleted job's name sees that job's pods under the same label: never its own
    pods, predecessors = _split_by_owner(pods, body["metadata"]["uid"])
    adapter = adapter_for(job.spec.scheduling.gang)
    replicas = _observe(adapter, pods, nodes, now, cfg)
    reported, unreachable, source = await _progress(cfg, namespace, name, body["metadata"]["uid"], pods,
                                                    status.attempt)
    observed = Observed(replicas=replicas, latest_checkpoint=reported.checkpoint, progress=reported.progress,
                        progress_unreachable=unreachable, generation=body["metadata"].get("generation"),
                        skipped_checkpoints=reported.skipped, created=body["metadata"].get("creationTimestamp"),
                        checkpoint_policy=reported.policy, work_at_risk=reported.at_risk,
                        autoscaler=cfg.settings.autoscale, progress_source=source)
    admitting = not replicas and status.phase not in TERMINAL_PHASES and not job.spec.suspend
    # An elastic gang running below its size: can it grow back? (the same capacity read, without creating)
    growing = (job.spec.elastic and status.phase == "Running" and not job.spec.suspend
               and (status.replicas or job.spec.replicas) < job.spec.replicas)
    # The pod policy holds whenever pods are about to be created (a webhook may be off, or the policy stricter now
    # than when the job was admitted); running pods are left as they are, as Pod Security Admission does.
    if (admitting or growing) and (refused := job_policy_problems(job.spec, cfg.settings.pod_policy, name)):
        return await _invalid(kube, body, status, SpecError(refused), emit, now, reason="PodPolicy")
    if (admitting or growing) and (unbuildable := _unbuildable(job, name, namespace, status.attempt + 1, cfg)):
        return await _invalid(kube, body, status, unbuildable, emit, now, reason="InvalidSpec")
    if growing:
        observed = replace(observed, capacity=await _free(kube, cfg, views, nodes, (namespace, name)))
    owner = m.Owner(name=name, namespace=namespace, uid=body["metadata"]["uid"])
    reserved: list[tuple[str, str]] = []
    if admitting and job.spec.scheduling.gang == "native" and cfg.admissions is not None and not predecessors:
        def plan(capacity: tuple[Node, ...] | None, blocked: str | None) -> tuple[Decision, list[dict]]:
            seen = replace(observed, capacity=capacity) if blocked is None else replace(observed, unschedulable=blocked)
            d = decide(job, status, seen, now)
            return d, _placed_pods(job, d, owner, cfg)

        priority = await _priority(kube, cfg, job.spec.scheduling.priority_class_name)
        waited_from = time.perf_counter()
        decision, reserved = await cfg.admissions.admit((namespace, name), priority,
                                                        body["metadata"].get("creationTimestamp") or "", plan)
        admission_wait.append(time.perf_counter() - waited_from)
    else:
        if cfg.admissions is not None:  # not waiting in the admission cycles (any more)
            cfg.admissions.done((namespace, name))
        async with _ADMISSION if admitting else contextlib.nullcontext():
            if admitting:
                if job.spec.scheduling.gang == "native":
                    # read here, under the lock, not before waiting for it: see `_free`
                    observed = replace(observed, capacity=await _free(kube, cfg, views, nodes, (namespace, name)))
                else:
                    observed = replace(observed, unschedulable=await admission(kube, job))
                if predecessors:  # their names are this job's first attempt's: wait until they are gone
                    observed = replace(observed, unschedulable=await _predecessors_going(kube, predecessors))
            decision = decide(job, status, observed, now)
            if admitting and job.spec.scheduling.gang == "native":  # pods the core placed (others: no node yet)
                reserved = cfg.busy.reserve(_placed_pods(job, decision, owner, cfg))
    try:
        return await _write_and_act(kube, cfg, body, job, decision, owner, emit, now, pods, reserved)
    except BaseException:
        cfg.busy.release(reserved)  # still listed only if not created (or not all of it): it takes no capacity
        raise


def _unbuildable(job: SeqTrainJob, name: str, namespace: str, attempt: int, cfg: Config) -> SpecError | None:
    """Why the job's objects cannot be built (None: they can), tried on its ConfigMap and first pod before any is
    created: a spec that passed validation but breaks a builder (a shape no rule checks yet) gets one Failed
    condition naming the error, not a pass that raises the same error every time."""
    owner = m.Owner(name=name, namespace=namespace, uid="")
    try:
        m.build_configmap(job, owner, attempt, cfg.settings, None)
        m.build_pod(job, owner, attempt, 0, cfg.settings, None)
    except Exception as exc:  # noqa: BLE001 - any builder error is this job's, and the same on every pass
        log.warning("%s/%s: its objects cannot be built (%s: %s)", namespace, name, type(exc).__name__, exc)
        return SpecError([Problem("spec", f"the job's pods cannot be built from this spec ({type(exc).__name__}: "
                                          f"{str(exc)[:200]}); check spec.podTemplate against core/v1's shapes")])
    return None


def _placed_pods(job: SeqTrainJob, decision: Decision, owner: m.Owner, cfg: Config) -> list[dict]:
    """The pods of the gangs `decision` creates, as the capacity reservations keep them (k8s/busy.py): projected
    (k8s/project.py: names, labels, node, requests) as the mirror keeps a created pod. Whole manifests (env,
    volumes, the trainer's command) held by every reservation until its pod shows in the cache were, beside the
    pass's own copies, the 300-job run's largest allocations at its peak."""
    out = []
    for a in decision.of(CreateGang):
        sized, nodes = _sized(job, a), {r.replica: r.node for r in a.plan.replicas} if a.plan is not None else {}
        out.extend(project.pod(m.build_pod(sized, owner, a.attempt, r, cfg.settings, nodes.get(r)))
                   for r in range(sized.spec.replicas))
    return out


async def _progress(cfg: Config, namespace: str, name: str, uid: str, pods: list[dict],
                    attempt: int) -> tuple[Reported, str | None, str | None]:
    """(what rank 0 reports, why it could not be read, where it came from: "pushed" or "polled"). Pushed progress
    while it is fresh (no request at all), else a poll of rank 0, else its termination message once it exited."""
    pushing = bool(cfg.push_port and cfg.settings.progress_push_url and cfg.settings.push_key)
    if pushing and (pushed := cfg.pushed.fresh(namespace, name, uid, cfg.push_fresh, attempt)) is not None:
        return pushed, None, "pushed"
    reported, unreachable, source = Reported(), None, None
    ip = rank0_ip(pods, attempt)
    if cfg.poll_progress and cfg.settings.progress_port and ip:
        reported = await poll_progress(ip, cfg.settings.progress_port, cfg.progress_timeout)
        if reported.progress is None:
            unreachable = f"GET {progress_url(ip, cfg.settings.progress_port)} did not answer"
            if pushing:
                unreachable += f" and rank 0 pushed nothing in the last {cfg.push_fresh:g}s"
        else:
            source = "polled"
    elif pushing and ip:  # push only: a channel that went quiet is no proof of a hang either
        unreachable = f"rank 0 pushed no progress in the last {cfg.push_fresh:g}s"
    if reported.progress is None:
        reported = final_progress(pods, attempt)
    return reported, unreachable, source


async def _priority(kube: Kube, cfg: Config, name: str | None) -> int:
    """The admission order's priority: the PriorityClass's value (0 without one, or when it cannot be read)."""
    if not name:
        return 0
    hit = cfg.priorities.get(name)
    if hit is not None and time.monotonic() - hit[1] < PRIORITY_TTL_SECONDS:
        return hit[0]
    try:
        value = await kube.priority_value(name) or 0
    except Exception as exc:  # noqa: BLE001 - an order, never a reason not to admit
        log.info("PriorityClass %s not readable (%s); admitting at priority 0", name, exc)
        value = 0
    cfg.priorities[name] = (value, time.monotonic())
    return value


def _sized(job: SeqTrainJob, action: CreateGang) -> SeqTrainJob:
    return job.with_replicas(action.replicas) if action.replicas is not None else job


async def _write_and_act(kube: Kube, cfg: Config, body: dict[str, Any], job: SeqTrainJob, decision: Decision,
                         owner: m.Owner, emit: EventSink, now: datetime, pods: list[dict],
                         reserved: list[tuple[str, str]]) -> Outcome:
    meta = body["metadata"]
    namespace, name, rv = meta["namespace"], meta["name"], meta["resourceVersion"]
    old_status = dict(body.get("status") or {})
    new = decision.status
    _storage_condition(job, new, now)

    new_dict = new.to_dict()
    recent = time.monotonic() - cfg.written_at.get((namespace, name), float("-inf")) < cfg.progress_interval
    if _changed(old_status, new_dict, coalesce_progress=recent):
        try:
            written = await kube.write_status(namespace, name, _status_patch(old_status, new_dict), rv)
        except Conflict as conflict:
            log.info("%s/%s changed while reconciling%s; again on fresh data", namespace, name,
                     " (maybe by this write: an earlier attempt of it timed out)" if conflict.unsure else "")
            cfg.known[(namespace, name)] = STALE  # read it again (a GET), not the watch's body that lost
            cfg.written.pop((namespace, name), None)
            if not conflict.unsure:
                cfg.busy.release(reserved)
            # Unsure: the status may name this gang's placement now, and the next pass would create its pods there;
            # released, that capacity went to the next gang (the 3000-job run pinned 8 gangs to full nodes so).
            # Kept, the reservations end when their pods show, or when this job's next admission replaces them
            # (the same attempt's pods have the same names).
            return Outcome(requeue=0.2, status=JobStatus.model_validate(old_status))
        cfg.written_at[(namespace, name)] = time.monotonic()
        if written and (written_rv := (written.get("metadata") or {}).get("resourceVersion")):
            cfg.known[(namespace, name)] = written_rv
            cfg.written[(namespace, name)] = (rv, project.job(written))

    act = functools.partial(_act, kube, cfg, body, job, decision, owner, emit, now, pods, reserved)
    if cfg.creations is not None and decision.of(CreateGang):
        # Creating is most of the gang's requests and of their wait for the budget: beside the passes (see
        # k8s/creations.py). The status naming the attempt is written, so nothing is lost if the operator stops.
        cfg.creations.start((namespace, name), functools.partial(_handed_off, act, cfg, reserved))
        return Outcome(requeue=None, status=new, events=tuple(decision.of(Event)))
    return await act()


async def _handed_off(act: Callable[[], Awaitable[Outcome]], cfg: Config, reserved: list[tuple[str, str]]
                      ) -> float | None:
    """`act` in a creation task: the job's next pass when it asks; what it reserved and did not create is released
    whatever ends it (an error or a cancel; the pass's own `except` no longer runs around it)."""
    try:
        return (await act()).requeue
    except BaseException:
        cfg.busy.release(reserved)
        raise


async def _act(kube: Kube, cfg: Config, body: dict[str, Any], job: SeqTrainJob, decision: Decision,
               owner: m.Owner, emit: EventSink, now: datetime, pods: list[dict],
               reserved: list[tuple[str, str]]) -> Outcome:
    """Act on a decision whose status is written: delete and create gangs, then the decision's Events."""
    namespace, name = owner.namespace, owner.name
    old_status = dict(body.get("status") or {})
    new = decision.status
    bulk = cfg.creations is not None  # in a creation task: behind the passes' requests (client.Budget.bulk)
    for action in decision.actions:
        if isinstance(action, DeleteGang):
            await delete_gang(kube, job, owner, action.attempt, action.force_nodes)
        elif isinstance(action, CreateGang):
            try:
                exist = await _existing(kube, cfg, owner, action.attempt, int(old_status.get("attempt") or 0))
                await create_gang(kube, _sized(job, action), owner, action.attempt, cfg.settings, action.plan,
                                  exist, functools.partial(_remember, cfg.expected, (namespace, name), action.attempt),
                                  action.in_place_delays, failure_history(decision.status, cfg.settings.rank_mtbf_hours),
                                  bulk=bulk)
                cfg.busy.created(reserved)
                reserved.clear()  # they exist: the index or their DELETED event ends them, not an error in a later step
            except GangRefused as refused:
                cfg.busy.release(reserved)
                return await _create_failed(kube, cfg, body, job, owner, new, action.attempt, str(refused), emit,
                                            now)
            except NameTaken as taken:
                # A deleted namesake's object (its ConfigMap, its Service) still holds the name: it is deleted (it
                # belongs to no job now) and the next pass creates what is absent; the status already names the
                # attempt. Never charged: nothing failed.
                cfg.busy.release(reserved)
                log.info("%s/%s: %s; creating it once it is gone", namespace, name, taken)
                if taken.uid is not None and not taken.terminating:
                    await kube.delete_exact(taken.api_version, taken.kind, namespace, taken.name, taken.uid)
                for ev in decision.of(Event):
                    emit(body, ev.type, ev.reason, ev.message)
                return Outcome(requeue=1.0, status=new, events=tuple(decision.of(Event)))
    adapter = adapter_for(job.spec.scheduling.gang)
    if adapter is not None and new.phase in TERMINAL_PHASES:
        await adapter.on_finished(kube, job, owner, pods)
    elif adapter is not None and (c := cond.get(new, "Scheduled")) is not None and c.reason == "Queued":
        await adapter.on_queued(kube, job, owner, new.attempt)
    elif adapter is not None and new.phase == "Running" and cfg.settings.kueue_boost_seconds > 0:
        await adapter.on_running(kube, job, owner, priority_boost(new.work_at_risk, cfg.settings.kueue_boost_seconds,
                                                                  cfg.settings.kueue_boost_max))
    for ev in decision.of(Event):
        emit(body, ev.type, ev.reason, ev.message)
    if decision.of(DeleteJob):  # last: the events above still name a live object
        await calls.delete_job(kube, namespace, name)
        return Outcome(requeue=None, status=new, events=tuple(decision.of(Event)))
    return Outcome(requeue=_requeue(decision, new, cfg), status=new, events=tuple(decision.of(Event)))


# kopf writes no change-detection annotation (handlers.NoDiffBase): its only first write to a new job is the
# finalizer. A kopf that did not write it would only make a new job wait this long for its first pass.
KOPF_SETTLE_SECONDS = 10.0


def _kopf_settling(body: dict[str, Any], now: datetime) -> bool | None:
    """Whether kopf has yet to make its first write to a new job (its finalizer): True, wait for it; False, it is
    late (KOPF_SETTLE_SECONDS): read the job, the watch may be behind; None: done."""
    meta = body["metadata"]
    if body.get("status") or FINALIZER in (meta.get("finalizers") or ()):
        return None
    created = parse(meta.get("creationTimestamp"))
    return created is None or (now - created).total_seconds() < KOPF_SETTLE_SECONDS


def _cache_behind(cfg: Config, body: dict[str, Any], status: JobStatus) -> bool:
    """The job's live attempt has pods this operator created (and saw no DELETED event of), and nothing else
    changed since (the spec's generation is the observed one)."""
    if status.phase != "Scheduling" or status.attempt < 1 or \
            body["metadata"].get("generation") != status.observed_generation:
        return False
    return bool(cfg.expected.known((body["metadata"]["namespace"], body["metadata"]["name"]), status.attempt))


def _split_by_owner(pods: list[dict], uid: str) -> tuple[list[dict], list[dict]]:
    """(this job's pods, those of a deleted job of the same name that are still there)."""
    ours, others = [], []
    for p in pods:
        (ours if owned_by(p, uid) else others).append(p)
    return ours, others


async def _predecessors_going(kube: Kube, pods: list[dict]) -> str:
    """Delete what a deleted namesake left running (the garbage collector would, later), and say what is awaited."""
    for p in pods:
        meta = p["metadata"]
        if not meta.get("deletionTimestamp") and meta.get("uid"):
            await kube.delete_exact("v1", "Pod", meta["namespace"], meta["name"], meta["uid"])
    names = ", ".join(sorted(p["metadata"]["name"] for p in pods)[:5])
    return (f"waiting for {len(pods)} pod(s) of a deleted SeqTrainJob of the same name to end ({names}): their "
            f"names are this job's")


def _remember(expected: Expectations, job: tuple[str, str], attempt: int, pod: str) -> None:
    expected.created(job, attempt, [pod])


async def _existing(kube: Kube, cfg: Config, owner: m.Owner, attempt: int, attempt_before: int) -> set[str]:
    """Pods of `attempt` that exist although the cache may not show them. A new attempt (the status named an earlier
    one before this pass, and it is written before anything is created) has none. Re-creating the live attempt's
    absent pods, the expectations say which this operator created; when they cannot say (a fresh operator), one
    label-selected LIST does (a consistent read: a lagging cache never re-creates a gang)."""
    if attempt != attempt_before:
        return set()
    key = (owner.namespace, owner.name)
    known = cfg.expected.known(key, attempt)
    if known is None:
        selector = f"{m.LABEL_JOB}={owner.name},{m.LABEL_ATTEMPT}={attempt}"
        known = {p["metadata"]["name"] for p in await kube.list_pods(owner.namespace, selector)
                 if owned_by(p, owner.uid)}
        cfg.expected.created(key, attempt, known)
    return known


async def _create_failed(kube: Kube, cfg: Config, body: dict[str, Any], job: SeqTrainJob, owner: m.Owner,
                         status: JobStatus, attempt: int, message: str, emit: EventSink, now: datetime) -> Outcome:
    """Part of the gang was refused: the core says what to do (tear down, condition, Event, backoff)."""
    log.warning("%s/%s: gang attempt %d refused: %s", owner.namespace, owner.name, attempt, message)
    decision = create_failed(job, status, attempt, message, now)
    for action in decision.of(DeleteGang):
        await delete_gang(kube, job, owner, action.attempt)
    written = dict(body.get("status") or {})
    try:
        fresh = await kube.get_job(owner.namespace, owner.name)
        if fresh is None:
            return Outcome(requeue=None)
        written = dict(fresh.get("status") or {})
        await kube.write_status(owner.namespace, owner.name, _status_patch(written, decision.status.to_dict()),
                                fresh["metadata"]["resourceVersion"])
    except Conflict:
        return Outcome(requeue=0.2, status=status)
    for ev in decision.of(Event):
        emit(body, ev.type, ev.reason, ev.message)
    return Outcome(requeue=_requeue(decision, decision.status, cfg), status=decision.status,
                   events=tuple(decision.of(Event)))


def _requeue(decision: Decision, status: JobStatus, cfg: Config) -> float | None:
    """Seconds until the next pass; None: only an event (a pod or node change) wakes the job again. A finished
    job with nothing left to delete is not polled at all."""
    requeues = decision.of(RequeueAfter)
    if status.phase in TERMINAL_PHASES and not requeues and not decision.of(DeleteGang):
        return None
    default = cfg.running_poll if status.phase in ("Running", "Scheduling", "Restarting") else cfg.idle_poll
    return max(0.05, min([r.seconds for r in requeues] + [default]))


def _storage_condition(job: SeqTrainJob, st: JobStatus, now: datetime) -> None:
    ck = job.spec.checkpoint
    if ck.pvc or (ck.path and "://" in ck.path):
        cond.set_condition(st, "CheckpointsPersistent", "True", "Configured",
                           f"checkpoints on {'PVC ' + ck.pvc if ck.pvc else ck.path}", now)
    else:
        cond.set_condition(st, "CheckpointsPersistent", "False", "EmptyDir",
                           "no checkpoint.pvc: checkpoints live in the pods' emptyDir and a restarted gang starts "
                           "from scratch; set spec.checkpoint.pvc to a ReadWriteMany claim", now)


async def _invalid(kube: Kube, body: dict, status: JobStatus, err: SpecError, emit: EventSink,
                   now: datetime, reason: str = "InvalidSpec") -> Outcome:
    """A spec the webhook would have rejected (installed without it, or an older operator's object)."""
    if status.phase == "Failed":
        return Outcome(requeue=None, status=status)
    msg = "; ".join(str(p) for p in err.problems)[:1000]
    cond.enter_phase(status, "Failed", reason, msg, now)
    meta = body["metadata"]
    try:
        await kube.write_status(meta["namespace"], meta["name"], status.to_dict(), meta["resourceVersion"])
    except Conflict:
        return Outcome(requeue=0.2, status=status)
    emit(body, "Warning", reason, msg)
    return Outcome(requeue=None, status=status)


class GangRefused(Exception):
    """The API server refused an object of the gang for good (403 Forbidden: quota or RBAC; 422 Invalid: an
    admission plugin or validation; 400). The message is the API's own."""


async def create_gang(kube: Kube, job: SeqTrainJob, owner: m.Owner, attempt: int, settings: m.Settings,
                      plan: Plan | None, exist: Collection[str] = (),
                      on_created: Callable[[str], None] | None = None,
                      in_place_delays: tuple[float, ...] = (), history: FailureHistory | None = None,
                      bulk: bool = False) -> list[dict]:
    """Create what is absent of this attempt's objects; existing ones (a repeat after a crash) are kept; returns the
    gang's pods. `exist`: names of pods known to exist (not POSTed again; when all do, nothing is); `on_created`
    is told each pod that exists once its creation returned; `bulk`: the requests wait behind the passes' own
    (client.Budget.bulk). Raises GangRefused when the API server refuses one:
    the caller tears the partial gang down."""
    gang = m.build_gang(job, owner, attempt, settings, plan, in_place_delays, history)
    absent = [p for p in gang.pods if p["metadata"]["name"] not in exist]
    if not absent:
        return gang.pods

    async def create(obj: dict[str, Any]) -> None:
        try:
            await (kube.create(obj, bulk=True) if bulk else kube.create(obj))
        except ApiException as exc:
            if exc.status in (400, 403, 422):
                raise GangRefused(f"{obj['kind']} {obj['metadata']['name']}: {api_message(exc)}") from exc
            raise
        if obj["kind"] == "Pod" and on_created is not None:
            on_created(obj["metadata"]["name"])

    netpol = [m.build_network_policy(job, owner, settings)] if settings.network_policy else []
    pdb = [m.build_pdb(owner)] if job.spec.scheduling.pod_disruption_budget else []
    for obj in [m.build_service(owner, settings), *netpol, *pdb, gang.configmap,
                *([gang.push_secret] if gang.push_secret else []),
                *([gang.podgroup] if gang.podgroup else [])]:
        await create(obj)  # what the pods refer to, first
    # The pods together: one admission holds the admission lock until its pods exist, so their creation time is
    # every queued job's wait. All are attempted; the first refusal (or error) is raised after.
    results = await asyncio.gather(*(create(p) for p in absent), return_exceptions=True)
    for r in results:
        if isinstance(r, GangRefused):
            raise r
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return gang.pods


async def delete_gang(kube: Kube, job: SeqTrainJob, owner: m.Owner, attempt: int,
                      force_nodes: tuple[str, ...] = ()) -> None:
    """Delete every pod of an attempt (graceful: the trainer checkpoints on SIGTERM), its ConfigMap, PodGroup.
    Pods on lost nodes are force-deleted first: no kubelet there will ever confirm a graceful deletion."""
    selector = f"{m.LABEL_JOB}={owner.name},{m.LABEL_ATTEMPT}={attempt}"
    for node in force_nodes:
        await kube.delete_pods(owner.namespace, selector, node=node, force=True)
    await kube.delete_pods(owner.namespace, selector)
    await kube.delete_configmaps(owner.namespace, selector)
    adapter = adapter_for(job.spec.scheduling.gang)
    if adapter is not None and adapter.podgroup_api:
        await kube.delete_custom(adapter.podgroup_api, adapter.podgroup_plural, owner.namespace,
                                 adapter.group_name(job, owner, attempt))


def _observe(adapter: GangScheduler | None, pods: list[dict], nodes: list[dict], now: datetime,
             cfg: Config) -> tuple[ReplicaObservation, ...]:
    """Pods -> replicas, through the gang scheduler's eyes: pods it merely keeps (its finalizer on an ended pod)
    are left out, and pods waiting in its queue are marked queued."""
    if adapter is None:  # native: kube-scheduler's queue
        live, waiting = pods, awaiting_scheduler
    else:
        live, waiting = [p for p in pods if not adapter.released(p)], adapter.queued
    queued = {(p["metadata"].get("labels") or {}).get(m.LABEL_ATTEMPT, "") + "/" +
              (p["metadata"].get("labels") or {}).get(m.LABEL_REPLICA, "") for p in live if waiting(p)}
    return tuple(replace(r, queued=True) if r.phase == "Pending" and f"{r.attempt}/{r.replica}" in queued else r
                 for r in observe_replicas(live, nodes, now, cfg.node_lost_grace, cfg.termination_overdue))


async def cleanup(kube: Kube, namespace: str, name: str) -> bool:
    """On deletion of the job (finalizer): stop the pods gracefully now rather than waiting for the garbage
    collector (pods of a KAI gang have no ownerReference: this is what removes them); everything else goes with
    the ownerReferences. Then each gang scheduler releases what it holds (Kueue: its Workload and finalizers).
    False: something still holds a pod; call again shortly."""
    selector = f"{m.LABEL_JOB}={name}"
    await kube.delete_pods(namespace, selector)
    pods = await kube.list_pods(namespace, selector)
    done = True
    for adapter in ADAPTERS.values():
        done = await adapter.on_job_deleted(kube, namespace, name, pods) and done
    return done


ReconcileFn = Callable[[], Awaitable[Outcome]]
