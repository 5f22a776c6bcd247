"""One reconcile pass of one SeqTrainJob, in stages (`Pass.run`: read, observe, decide, write status, act, events).

1. Read the job (k8s/passes/readjob.py: kopf's live body where it is the newest this operator knows, else a GET).
2. Observe: pods (from the operator's mirrors, `Views`) -> ReplicaObservation, rank 0's progress; when no gang
   exists, gang admission: the native placement over free node capacity, or the presence of the external gang
   scheduler.
3. Decide with the shared controller core (`seqtrain_operator.controller.decide`), the same as local runs.
4. Write the status, with the job's resourceVersion as an optimistic lock: on 409 nothing was done and the pass
   is repeated on fresh data. Writing it BEFORE acting means a crash between the two never forgets a gang it
   created: the status already names the attempt, and the core re-creates whatever of it is absent.
5. Act: delete gangs (pods, ConfigMap, PodGroup of that attempt), create the gang (create-if-absent, so a repeat
   never duplicates anything: names are deterministic per attempt). In the operator, a decision that creates a
   gang is acted on in a creation task beside the passes (k8s/passes/creations.py), not in the pass.
6. Emit the decision's Kubernetes Events, only after the status write succeeded (and the gang was created).

What the pass remembers of the job between passes is its JobMemory (k8s/cache/memory.py); what it shares with every
other pass (the API client, the reservations, the admission cycles) is its `Reconciler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

from kubernetes.client.rest import ApiException

from seqtrain.spec import JobStatus, SeqTrainJob, SpecError, parse_job
from seqtrain.spec.policy import job_policy_problems
from seqtrain.spec.problems import Problem
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
    utcnow,
)
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller.checkpoint_policy import failure_history, priority_boost
from seqtrain_operator.controller.types import Decision
from seqtrain_operator.k8s.api import calls
from seqtrain_operator.k8s.api.client import Conflict, Kube, NameTaken, api_message
from seqtrain_operator.k8s.cache import project
from seqtrain_operator.k8s.cache.memory import STALE, JobMemory, Jobs
from seqtrain_operator.k8s.capacity.admission import PRIORITY_TTL_SECONDS, Admissions
from seqtrain_operator.k8s.capacity.busy import BusyPods
from seqtrain_operator.k8s.gangs import ADAPTERS, GangScheduler, adapter_for
from seqtrain_operator.k8s.owner import Owner, owned_by
from seqtrain_operator.k8s.passes.creations import Creations
from seqtrain_operator.k8s.passes.readjob import kopf_settling, read_job
from seqtrain_operator.k8s.passes.statuspatch import changed, status_patch, storage_condition
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.pods.observe import (
    Reported,
    awaiting_scheduler,
    final_progress,
    observe_replicas,
    rank0_ip,
)
from seqtrain_operator.k8s.progress.poll import poll_progress, progress_url
from seqtrain_operator.k8s.progress.push import PushedProgress
from seqtrain_operator.k8s.settings import Settings
from seqtrain_operator.planner.inventory import inventory
from seqtrain_operator.planner.types import Node

log = logging.getLogger("seqtrain.operator")

EventSink = Callable[[dict[str, Any], str, str, str], None]
Key = tuple[str, str]  # (namespace, name)


@dataclass
class Outcome:
    requeue: float | None  # seconds until the next pass; None: the job is gone
    status: JobStatus | None = None
    events: tuple[Event, ...] = ()


class Views(Protocol):
    """Where a pass reads its job's pods and the nodes: the operator's in-memory mirrors (k8s/cache/mirror.py; no LIST
    per pass), or what a test feeds it. A view may also answer `free(job, busy)` (the capacity ledger,
    k8s/capacity/ledger.py)."""

    def pods(self, namespace: str, job: str) -> list[dict]: ...

    def all_pods(self) -> list[dict]: ...

    def nodes(self) -> list[dict]: ...


@dataclass(eq=False)
class Reconciler:
    """What every pass shares: the API client, the settings, each job's memory, the capacity reservations, the
    pushed progress, the admission cycles and the gang creations (None: admitted one gang at a time under `lock`,
    created inside the pass), PriorityClass values. Made once per operator (k8s/process/runtime.py) or per test."""

    kube: Kube
    settings: Settings = field(default_factory=Settings)
    jobs: Jobs = field(default_factory=Jobs)
    busy: BusyPods = field(default_factory=BusyPods)  # admission's view of the cluster's pods, and reservations
    pushed: PushedProgress = field(default_factory=PushedProgress)
    admissions: Admissions | None = None  # native admission in cycles for waiting gangs (k8s/capacity/admission.py)
    creations: Creations | None = None  # gang creations beside the passes (k8s/passes/creations.py)
    # PriorityClass name -> (value, time.monotonic() read): the admission order
    priorities: dict[str, tuple[int, float]] = field(default_factory=dict)
    # One admission decision at a time outside the cycles: two jobs planned concurrently would both see the same
    # free capacity. Held from reading the capacity until the planned pods are reserved in `busy`.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def reconcile(self, namespace: str, name: str, emit: EventSink, views: Views, now: datetime | None = None,
                        admission_wait: list[float] | None = None) -> Outcome:
        """One pass. `admission_wait` is told the seconds the pass waited for its admission cycle (queueing, not
        the pass's own work)."""
        return await Pass(self, namespace, name, emit, views, now or utcnow(),
                          admission_wait if admission_wait is not None else []).run()

    def forget(self, uid: str) -> JobMemory | None:
        """The job incarnation `uid` was deleted: its memory goes, and so does what the shared objects hold for it
        (its pushed progress; its admission wait and reservations unless a namesake was created since)."""
        mem = self.jobs.forget(uid)
        self.pushed.forget(uid)
        if mem is not None and self.jobs.get(*mem.key) is None:
            if self.admissions is not None:
                self.admissions.done(mem.key)
            self.busy.release_job(mem.key)
        return mem

    async def progress(self, owner: Owner, pods: list[dict], attempt: int
                       ) -> tuple[Reported, str | None, str | None]:
        """(what rank 0 reports, why it could not be read, where it came from: "pushed" or "polled"). Pushed
        progress while it is fresh (no request at all), else a poll of rank 0, else its termination message once it
        exited."""
        s = self.settings
        pushing = bool(s.push_port and s.pods.progress_push_url and s.pods.push_key)
        if pushing and (pushed := self.pushed.fresh(owner.namespace, owner.name, owner.uid, s.push_fresh,
                                                    attempt)) is not None:
            return pushed, None, "pushed"
        reported, unreachable, source = Reported(), None, None
        ip = rank0_ip(pods, attempt)
        if s.poll_progress and s.pods.progress_port and ip:
            reported = await poll_progress(ip, s.pods.progress_port, s.progress_timeout)
            if reported.progress is None:
                unreachable = f"GET {progress_url(ip, s.pods.progress_port)} did not answer"
                if pushing:
                    unreachable += f" and rank 0 pushed nothing in the last {s.push_fresh:g}s"
            else:
                source = "polled"
        elif pushing and ip:  # push only: a channel that went quiet is no proof of a hang either
            unreachable = f"rank 0 pushed no progress in the last {s.push_fresh:g}s"
        if reported.progress is None:
            reported = final_progress(pods, attempt)
        return reported, unreachable, source

    async def priority(self, name: str | None) -> int:
        """The admission order's priority: the PriorityClass's value (0 without one, or when it cannot be read)."""
        if not name:
            return 0
        hit = self.priorities.get(name)
        if hit is not None and time.monotonic() - hit[1] < PRIORITY_TTL_SECONDS:
            return hit[0]
        try:
            value = await self.kube.priority_value(name) or 0
        except Exception as exc:  # noqa: BLE001 - an order, never a reason not to admit
            log.info("PriorityClass %s not readable (%s); admitting at priority 0", name, exc)
            value = 0
        self.priorities[name] = (value, time.monotonic())
        return value


@dataclass(eq=False)
class Pass:
    """One pass of one job. `run()` is the stages; each stage fills the fields the next one reads."""

    r: Reconciler
    namespace: str
    name: str
    emit: EventSink
    views: Views
    now: datetime
    admission_wait: list[float] = field(default_factory=list)
    # read
    mem: JobMemory = field(init=False)
    body: dict[str, Any] = field(init=False)
    status: JobStatus = field(init=False)
    job: SeqTrainJob = field(init=False)
    owner: Owner = field(init=False)
    # observe
    pods: list[dict] = field(init=False)
    predecessors: list[dict] = field(init=False)  # pods of a deleted namesake, still there
    observed: Observed = field(init=False)
    admitting: bool = field(init=False)  # no gang exists and one may be created
    # decide
    decision: Decision = field(init=False)
    reserved: list[Key] = field(default_factory=list)  # capacity reserved for the pods this pass creates

    @property
    def key(self) -> Key:
        return self.namespace, self.name

    async def run(self) -> Outcome:
        if self.r.creations is not None and self.r.creations.busy(self.key):
            # its gang is being created: the creation's end schedules the next pass (this timer is a backstop)
            return Outcome(requeue=5.0)
        for stage in (self.read, self.observe, self.decide):
            if (done := await stage()) is not None:
                return done
        try:
            if (done := await self.write_status()) is not None:
                return done
            if self.r.creations is not None and self.decision.of(CreateGang):
                # Creating is most of the gang's requests and of their wait for the API budget: beside the passes
                # (k8s/passes/creations.py). The status naming the attempt is written: nothing is lost if the operator
                # stops.
                self.r.creations.start(self.key, self._handed_off)
                return Outcome(requeue=None, status=self.decision.status, events=self.events)
            return await self.act_and_emit()
        except BaseException:
            self.r.busy.release(self.reserved)  # still listed only if not created (or not all of it)
            raise

    @property
    def events(self) -> tuple[Event, ...]:
        return tuple(self.decision.of(Event))

    # ---- 1. read ---------------------------------------------------------------------------------------------

    async def read(self) -> Outcome | None:
        """The job, its status and spec, and this incarnation's memory; an early outcome when there is nothing to
        do (gone, being deleted, kopf still settling a new job, an invalid spec)."""
        mem = self.r.jobs.get(*self.key) or JobMemory(self.namespace, self.name, uid="")
        live = mem.live
        body = await read_job(self.r.kube, mem, live)
        if body is None or body["metadata"].get("deletionTimestamp"):
            mem.known, mem.written = None, None
            return Outcome(requeue=None)
        if live is not None and (settling := kopf_settling(body, self.now)) is not None:
            if settling:
                # A new job: kopf is adding its finalizer. Writing the status now races that PATCH (a 409, then a
                # GET and a retry); its watch event wakes us.
                return Outcome(requeue=1.0, status=JobStatus.model_validate(body.get("status") or {}))
            # kopf's patch is late (an operator behind on its events) or never comes: read the job rather than
            # write over a body the watch may not have updated.
            mem.known = STALE
            body = await read_job(self.r.kube, mem, live)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return Outcome(requeue=None)
        uid = body["metadata"].get("uid") or ""
        if mem.uid != uid:  # first sight (no daemon registered it), or a namesake's record: this one's own
            scratch, mem = mem, self.r.jobs.seen(self.namespace, self.name, uid)
            if not scratch.uid:
                mem.known, mem.written = scratch.known, scratch.written
        self.mem, self.body = mem, body
        self.status = JobStatus.model_validate(dict(body.get("status") or {}))
        self.owner = Owner(name=self.name, namespace=self.namespace, uid=uid)
        try:
            doc = {k: body[k] for k in ("apiVersion", "kind", "spec") if k in body}
            self.job = parse_job(doc | {"metadata": {"name": self.name, "namespace": self.namespace}})
        except SpecError as err:
            return await self.invalid(err)
        return None

    # ---- 2. observe ------------------------------------------------------------------------------------------

    async def observe(self) -> Outcome | None:
        """Replicas and progress as the core needs them; whether a gang may be created (then the pod policy and the
        builders must accept the spec) or an elastic gang may grow."""
        pods = self.views.pods(self.namespace, self.name)
        if not pods and self._cache_behind():
            # Our own creations are not in the mirror yet: nothing to decide on until they are (their events wake
            # the job). Deciding now would take the admission path for a gang that exists.
            return Outcome(requeue=self.r.settings.idle_poll, status=self.status)
        # A job re-applied under a deleted job's name sees that job's pods under the same label: never its own
        self.pods, self.predecessors = [], []
        for p in pods:
            (self.pods if owned_by(p, self.owner.uid) else self.predecessors).append(p)
        spec, status, s = self.job.spec, self.status, self.r.settings
        replicas = _replicas(adapter_for(spec.scheduling.gang), self.pods, self.views.nodes(), self.now, s)
        reported, unreachable, source = await self.r.progress(self.owner, self.pods, status.attempt)
        meta = self.body["metadata"]
        self.observed = Observed(
            replicas=replicas, latest_checkpoint=reported.checkpoint, progress=reported.progress,
            progress_unreachable=unreachable, generation=meta.get("generation"), skipped_checkpoints=reported.skipped,
            created=meta.get("creationTimestamp"), checkpoint_policy=reported.policy, work_at_risk=reported.at_risk,
            autoscaler=s.pods.autoscale, progress_source=source)
        self.admitting = not replicas and status.phase not in TERMINAL_PHASES and not spec.suspend
        # An elastic gang running below its size: can it grow back? (the same capacity read, without creating)
        growing = (spec.elastic and status.phase == "Running" and not spec.suspend
                   and (status.replicas or spec.replicas) < spec.replicas)
        if not (self.admitting or growing):
            return None
        # The pod policy holds whenever pods are about to be created (a webhook may be off, or the policy stricter
        # now than when the job was admitted); running pods are left as they are, as Pod Security Admission does.
        if refused := job_policy_problems(spec, s.pods.pod_policy, self.name):
            return await self.invalid(SpecError(refused), reason="PodPolicy")
        if (unbuildable := self._unbuildable()) is not None:
            return await self.invalid(unbuildable)
        if growing:
            self.observed = replace(self.observed, capacity=await self._free())
        return None

    def _cache_behind(self) -> bool:
        """The job's live attempt has pods this operator created (and saw no DELETED event of), and nothing else
        changed since (the spec's generation is the observed one)."""
        st = self.status
        if st.phase != "Scheduling" or st.attempt < 1 or self.body["metadata"].get("generation") != \
                st.observed_generation:
            return False
        return bool(self.mem.expected.known(st.attempt))

    def _unbuildable(self) -> SpecError | None:
        """Why the job's objects cannot be built (None: they can), tried on its ConfigMap and first pod before any
        is created: a spec that passed validation but breaks a builder (a shape no rule checks yet) gets one Failed
        condition naming the error, not a pass that raises the same error every time."""
        owner, attempt, pods = replace(self.owner, uid=""), self.status.attempt + 1, self.r.settings.pods
        try:
            m.build_configmap(self.job, owner, attempt, pods, None)
            m.build_pod(self.job, owner, attempt, 0, pods, None)
        except Exception as exc:  # noqa: BLE001 - any builder error is this job's, and the same on every pass
            log.warning("%s/%s: its objects cannot be built (%s: %s)", self.namespace, self.name,
                        type(exc).__name__, exc)
            return SpecError([Problem("spec", f"the job's pods cannot be built from this spec "
                                              f"({type(exc).__name__}: {str(exc)[:200]}); check spec.podTemplate "
                                              "against core/v1's shapes")])
        return None

    async def _free(self) -> tuple[Node, ...]:
        """Free capacity per node from the views as they are now: read at the moment of the decision, not at the
        start of the pass (queued behind other admissions, gangs created meanwhile must count)."""
        if (free := getattr(self.views, "free", None)) is not None:  # the operator's capacity ledger
            return tuple(await free(self.key, self.r.busy))
        return await capacity(self.r.kube, self.views.nodes(), self.r.busy, self.key, self.views.all_pods())

    # ---- 3. decide -------------------------------------------------------------------------------------------

    async def decide(self) -> None:
        """The core's decision; a native gang being admitted is planned in the admission cycle (or under the lock)
        and its placed pods reserved before the next gang is planned."""
        native = self.job.spec.scheduling.gang == "native"
        if self.admitting and native and self.r.admissions is not None and not self.predecessors:
            priority = await self.r.priority(self.job.spec.scheduling.priority_class_name)
            waited_from = time.perf_counter()
            self.decision, self.reserved = await self.r.admissions.admit(
                self.key, priority, self.body["metadata"].get("creationTimestamp") or "", self._plan)
            self.admission_wait.append(time.perf_counter() - waited_from)
            return None
        if self.r.admissions is not None:  # not waiting in the admission cycles (any more)
            self.r.admissions.done(self.key)
        async with self.r.lock if self.admitting else contextlib.nullcontext():
            if self.admitting:
                if native:  # read here, under the lock, not before waiting for it: see `_free`
                    self.observed = replace(self.observed, capacity=await self._free())
                else:
                    self.observed = replace(self.observed, unschedulable=await admission(self.r.kube, self.job))
                if self.predecessors:  # their names are this job's first attempt's: wait until they are gone
                    why = await _predecessors_going(self.r.kube, self.predecessors)
                    self.observed = replace(self.observed, unschedulable=why)
            self.decision = decide(self.job, self.status, self.observed, self.now)
            if self.admitting and native:  # pods the core placed (others: no node yet)
                self.reserved = self.r.busy.reserve(self._placed_pods(self.decision))
        return None

    def _plan(self, capacity: tuple[Node, ...] | None, blocked: str | None) -> tuple[Decision, list[dict]]:
        """The admission cycle's question (k8s/capacity/admission.py): the decision with this capacity, or refused."""
        seen = replace(self.observed, capacity=capacity) if blocked is None else \
            replace(self.observed, unschedulable=blocked)
        d = decide(self.job, self.status, seen, self.now)
        return d, self._placed_pods(d)

    def _placed_pods(self, decision: Decision) -> list[dict]:
        """The pods of the gangs `decision` creates, as the capacity reservations keep them (k8s/capacity/busy.py):
        projected (k8s/cache/project.py: names, labels, node, requests) as the mirror keeps a created pod, not whole
        manifests held by every reservation until its pod shows in the mirror."""
        out = []
        for a in decision.of(CreateGang):
            sized, nodes = _sized(self.job, a), {r.replica: r.node for r in a.plan.replicas} if a.plan else {}
            out.extend(project.pod(m.build_pod(sized, self.owner, a.attempt, r, self.r.settings.pods, nodes.get(r)))
                       for r in range(sized.spec.replicas))
        return out

    # ---- 4. write status -------------------------------------------------------------------------------------

    async def write_status(self) -> Outcome | None:
        """Write the decided status if it changed (progress alone at most every progress_interval), with the
        job's resourceVersion as the lock. An outcome: the write conflicted, repeat on fresh data."""
        mem, meta = self.mem, self.body["metadata"]
        old_status, new = dict(self.body.get("status") or {}), self.decision.status
        storage_condition(self.job, new, self.now)
        new_dict = new.to_dict()
        recent = time.monotonic() - mem.written_at < self.r.settings.progress_interval
        if not changed(old_status, new_dict, coalesce_progress=recent):
            return None
        try:
            written = await self.r.kube.write_status(self.namespace, self.name, status_patch(old_status, new_dict),
                                                     meta["resourceVersion"])
        except Conflict as conflict:
            log.info("%s/%s changed while reconciling%s; again on fresh data", self.namespace, self.name,
                     " (maybe by this write: an earlier attempt of it timed out)" if conflict.unsure else "")
            mem.known, mem.written = STALE, None  # read it again (a GET), not the watch's body that lost
            if not conflict.unsure:
                self.r.busy.release(self.reserved)
            # Unsure: the status may name this gang's placement now, and the next pass would create its pods
            # there; released, that capacity would go to the next gang. Kept, the reservations end when their pods
            # show, or when this job's next admission replaces them (the same attempt's pods have the same names).
            return Outcome(requeue=0.2, status=JobStatus.model_validate(old_status))
        mem.written_at = time.monotonic()
        if written and (written_rv := (written.get("metadata") or {}).get("resourceVersion")):
            mem.known, mem.written = written_rv, (meta["resourceVersion"], project.job(written))
        return None

    # ---- 5. act, 6. emit events ------------------------------------------------------------------------------

    async def _handed_off(self) -> float | None:
        """`act_and_emit` in a creation task: the job's next pass when it asks; what it reserved and did not create
        is released whatever ends it (an error or a cancel: `run`'s own `except` no longer runs around it)."""
        try:
            return (await self.act_and_emit()).requeue
        except BaseException:
            self.r.busy.release(self.reserved)
            raise

    async def act_and_emit(self) -> Outcome:
        """Act on a decision whose status is written, then emit its Events."""
        if (done := await self.act()) is not None:
            return done
        return await self.emit_events()

    async def act(self) -> Outcome | None:
        """Delete and create gangs, then tell the gang scheduler's adapter. An outcome: a creation was refused or
        a name is still taken (the pass ends there)."""
        for action in self.decision.actions:
            if isinstance(action, DeleteGang):
                await self.delete_gang(action.attempt, action.force_nodes)
            elif isinstance(action, CreateGang) and (done := await self._create(action)) is not None:
                return done
        new, s = self.decision.status, self.r.settings.pods
        adapter = adapter_for(self.job.spec.scheduling.gang)
        if adapter is None:
            return None
        if new.phase in TERMINAL_PHASES:
            await adapter.on_finished(self.r.kube, self.job, self.owner, self.pods, self.mem)
        elif (c := cond.get(new, "Scheduled")) is not None and c.reason == "Queued":
            await adapter.on_queued(self.r.kube, self.job, self.owner, new.attempt, self.mem)
        elif new.phase == "Running" and s.kueue_boost_seconds > 0:
            boost = priority_boost(new.work_at_risk, s.kueue_boost_seconds, s.kueue_boost_max)
            await adapter.on_running(self.r.kube, self.job, self.owner, boost, self.mem)
        return None

    async def emit_events(self) -> Outcome:
        """The decision's Events (after its status write and its creations), then the job's own deletion."""
        new = self.decision.status
        for ev in self.decision.of(Event):
            self.emit(self.body, ev.type, ev.reason, ev.message)
        if self.decision.of(DeleteJob):  # last: the events above still name a live object
            await calls.delete_job(self.r.kube, self.namespace, self.name)
            return Outcome(requeue=None, status=new, events=self.events)
        return Outcome(requeue=_requeue(self.decision, new, self.r.settings), status=new, events=self.events)

    async def _create(self, action: CreateGang) -> Outcome | None:
        """Create what is absent of the gang; an outcome when the API refused part of it or a name is taken."""
        try:
            await self.create_gang(action)
            self.r.busy.created(self.reserved)
            self.reserved.clear()  # they exist: the mirror or their DELETED event ends them, not a later error
        except GangRefused as refused:
            self.r.busy.release(self.reserved)
            return await self.create_failed(action.attempt, str(refused))
        except NameTaken as taken:
            # A deleted namesake's object (its ConfigMap, its Service) still holds the name: it is deleted (it
            # belongs to no job now) and the next pass creates what is absent; the status already names the
            # attempt. Never charged: nothing failed.
            self.r.busy.release(self.reserved)
            log.info("%s/%s: %s; creating it once it is gone", self.namespace, self.name, taken)
            if taken.uid is not None and not taken.terminating:
                await self.r.kube.delete_exact(taken.api_version, taken.kind, self.namespace, taken.name, taken.uid)
            for ev in self.decision.of(Event):
                self.emit(self.body, ev.type, ev.reason, ev.message)
            return Outcome(requeue=1.0, status=self.decision.status, events=self.events)
        return None

    async def create_gang(self, action: CreateGang) -> list[dict]:
        """Create what is absent of this attempt's objects; existing ones (a repeat after a crash) are kept; returns
        the gang's pods. In a creation task the requests wait behind the passes' own (client.Budget.bulk). Raises
        GangRefused when the API server refuses one: the caller tears the partial gang down."""
        s, attempt = self.r.settings.pods, action.attempt
        history = failure_history(self.decision.status, s.rank_mtbf_hours)
        job = _sized(self.job, action)
        gang = m.build_gang(job, self.owner, attempt, s, action.plan, action.in_place_delays, history)
        exist = await self._existing(attempt)
        absent = [p for p in gang.pods if p["metadata"]["name"] not in exist]
        if not absent:
            return gang.pods
        bulk = self.r.creations is not None

        async def create(obj: dict[str, Any]) -> None:
            try:
                await (self.r.kube.create(obj, bulk=True) if bulk else self.r.kube.create(obj))
            except ApiException as exc:
                if exc.status in (400, 403, 422):
                    raise GangRefused(f"{obj['kind']} {obj['metadata']['name']}: {api_message(exc)}") from exc
                raise
            if obj["kind"] == "Pod":
                self.mem.expected.created(attempt, [obj["metadata"]["name"]])

        netpol = [m.build_network_policy(job, self.owner, s)] if s.network_policy else []
        pdb = [m.build_pdb(self.owner)] if job.spec.scheduling.pod_disruption_budget else []
        for obj in [m.build_service(self.owner, s), *netpol, *pdb, gang.configmap,
                    *([gang.push_secret] if gang.push_secret else []), *([gang.podgroup] if gang.podgroup else [])]:
            await create(obj)  # what the pods refer to, first
        # The pods together; all are attempted, and the first refusal (or error) is raised after.
        results = await asyncio.gather(*(create(p) for p in absent), return_exceptions=True)
        for r in results:
            if isinstance(r, GangRefused):
                raise r
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return gang.pods

    async def _existing(self, attempt: int) -> set[str]:
        """Pods of `attempt` that exist although the mirror may not show them. A new attempt (the status named an
        earlier one before this pass, and it is written before anything is created) has none. Re-creating the live
        attempt's absent pods, the expectations say which this operator created; when they cannot say (a fresh
        operator), one label-selected LIST does (a consistent read: a lagging mirror never re-creates a gang)."""
        if attempt != int((self.body.get("status") or {}).get("attempt") or 0):
            return set()
        known = self.mem.expected.known(attempt)
        if known is None:
            selector = f"{m.LABEL_JOB}={self.name},{m.LABEL_ATTEMPT}={attempt}"
            known = {p["metadata"]["name"] for p in await self.r.kube.list_pods(self.namespace, selector)
                     if owned_by(p, self.owner.uid)}
            self.mem.expected.created(attempt, known)
        return known

    async def delete_gang(self, attempt: int, force_nodes: tuple[str, ...] = ()) -> None:
        """Delete every pod of an attempt (graceful: the trainer checkpoints on SIGTERM), its ConfigMap, PodGroup.
        Pods on lost nodes are force-deleted first: no kubelet there will ever confirm a graceful deletion."""
        kube, ns = self.r.kube, self.namespace
        selector = f"{m.LABEL_JOB}={self.name},{m.LABEL_ATTEMPT}={attempt}"
        for node in force_nodes:
            await kube.delete_pods(ns, selector, node=node, force=True)
        await kube.delete_pods(ns, selector)
        await kube.delete_configmaps(ns, selector)
        adapter = adapter_for(self.job.spec.scheduling.gang)
        if adapter is not None and adapter.podgroup_api:
            await kube.delete_custom(adapter.podgroup_api, adapter.podgroup_plural, ns,
                                     adapter.group_name(self.job, self.owner, attempt))

    async def create_failed(self, attempt: int, message: str) -> Outcome:
        """Part of the gang was refused: the core says what to do (tear down, condition, Event, backoff)."""
        log.warning("%s/%s: gang attempt %d refused: %s", self.namespace, self.name, attempt, message)
        decision = create_failed(self.job, self.decision.status, attempt, message, self.now)
        for action in decision.of(DeleteGang):
            await self.delete_gang(action.attempt)
        try:
            fresh = await self.r.kube.get_job(self.namespace, self.name)
            if fresh is None:
                return Outcome(requeue=None)
            written = dict(fresh.get("status") or {})
            await self.r.kube.write_status(self.namespace, self.name,
                                           status_patch(written, decision.status.to_dict()),
                                           fresh["metadata"]["resourceVersion"])
        except Conflict:
            return Outcome(requeue=0.2, status=self.decision.status)
        for ev in decision.of(Event):
            self.emit(self.body, ev.type, ev.reason, ev.message)
        return Outcome(requeue=_requeue(decision, decision.status, self.r.settings), status=decision.status,
                       events=tuple(decision.of(Event)))

    async def invalid(self, err: SpecError, reason: str = "InvalidSpec") -> Outcome:
        """A spec the webhook would have rejected (installed without it, or an older operator's object), or one
        the pod policy or the builders refuse: Failed, with one condition naming the problems."""
        status = self.status
        if status.phase == "Failed":
            return Outcome(requeue=None, status=status)
        msg = "; ".join(str(p) for p in err.problems)[:1000]
        cond.enter_phase(status, "Failed", reason, msg, self.now)
        try:
            await self.r.kube.write_status(self.namespace, self.name, status.to_dict(),
                                           self.body["metadata"]["resourceVersion"])
        except Conflict:
            return Outcome(requeue=0.2, status=status)
        self.emit(self.body, "Warning", reason, msg)
        return Outcome(requeue=None, status=status)


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


async def capacity(kube: Kube, nodes: list[dict], busy: BusyPods, job: Key,
                   ours: list[dict] | None = None) -> tuple[Node, ...]:
    """Free capacity per node: allocatable minus the requests of every non-terminated pod bound or pinned to it,
    cluster-wide (what kube-scheduler subtracts too; pods created but not bound yet, and reserved ones, included).
    `ours`: this operator's pods from its mirror (None: LIST them too)."""
    return tuple(inventory(nodes, await busy.current(kube, job, ours)))


async def _predecessors_going(kube: Kube, pods: list[dict]) -> str:
    """Delete what a deleted namesake left running (the garbage collector would, later), and say what is awaited."""
    for p in pods:
        meta = p["metadata"]
        if not meta.get("deletionTimestamp") and meta.get("uid"):
            await kube.delete_exact("v1", "Pod", meta["namespace"], meta["name"], meta["uid"])
    names = ", ".join(sorted(p["metadata"]["name"] for p in pods)[:5])
    return (f"waiting for {len(pods)} pod(s) of a deleted SeqTrainJob of the same name to end ({names}): their "
            f"names are this job's")


def _sized(job: SeqTrainJob, action: CreateGang) -> SeqTrainJob:
    return job.with_replicas(action.replicas) if action.replicas is not None else job


def _requeue(decision: Decision, status: JobStatus, settings: Settings) -> float | None:
    """Seconds until the next pass; None: only an event (a pod or node change) wakes the job again. A finished
    job with nothing left to delete is not polled at all."""
    requeues = decision.of(RequeueAfter)
    if status.phase in TERMINAL_PHASES and not requeues and not decision.of(DeleteGang):
        return None
    default = settings.running_poll if status.phase in ("Running", "Scheduling", "Restarting") else settings.idle_poll
    return max(0.05, min([r.seconds for r in requeues] + [default]))


def _replicas(adapter: GangScheduler | None, pods: list[dict], nodes: list[dict], now: datetime,
              settings: Settings) -> tuple[ReplicaObservation, ...]:
    """Pods -> replicas, through the gang scheduler's eyes: pods it merely keeps (its finalizer on an ended pod)
    are left out, and pods waiting in its queue are marked queued."""
    if adapter is None:  # native: kube-scheduler's queue
        live, waiting = pods, awaiting_scheduler
    else:
        live, waiting = [p for p in pods if not adapter.released(p)], adapter.queued
    queued = {(p["metadata"].get("labels") or {}).get(m.LABEL_ATTEMPT, "") + "/" +
              (p["metadata"].get("labels") or {}).get(m.LABEL_REPLICA, "") for p in live if waiting(p)}
    return tuple(replace(r, queued=True) if r.phase == "Pending" and f"{r.attempt}/{r.replica}" in queued else r
                 for r in observe_replicas(live, nodes, now, settings.node_lost_grace, settings.termination_overdue))


class GangRefused(Exception):
    """The API server refused an object of the gang for good (403 Forbidden: quota or RBAC; 422 Invalid: an
    admission plugin or validation; 400). The message is the API's own."""


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
