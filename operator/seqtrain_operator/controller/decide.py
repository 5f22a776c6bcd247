"""The controller core: one pure function from (job, status, observed gang, now) to actions and the new status.

Level-based: decide() looks only at what is observed now and what the status records, never at which event woke
it, so calling it twice with the same inputs gives the same answer and a crashed backend resumes correctly.

Phases: Pending -> Scheduling (gang admitted and created, not all replicas running) -> Running -> Succeeded; on a
failure of the live gang: Restarting (gang deleted, waiting out the backoff) -> Scheduling -> Running ...; Failed when
the failure is permanent or the restart budget is spent; Suspended while spec.suspend is true. Succeeded and Failed
are terminal: decide() never leaves them (it only cleans up replicas that still run).

Invariants (property-tested in tests/unit/test_controller.py):
- at most one CreateGang per decision, and only when no replica of any attempt is observed (never two gangs);
- status.attempt, status.restarts and status.infraRestarts never decrease;
- status.restarts <= faultTolerance.maxRestarts and status.infraRestarts <= faultTolerance.maxInfraRestarts;
- restart delays follow backoff_seconds(): exponential, capped at maxBackoffSeconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import TERMINAL_PHASES, JobStatus, Progress, ReplicaPlacement
from seqtrain_operator.controller import checkpoint_policy, gang_policy, goodput, lost_time
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller.backoff import backoff_seconds
from seqtrain_operator.controller.clock import iso, parse, seconds_between
from seqtrain_operator.controller.failure_policy import (
    IMAGE_PULL_REASONS,
    Failure,
    FailureClass,
    hang_failure,
    root_cause,
)
from seqtrain_operator.controller.ttl import expire
from seqtrain_operator.controller.types import (
    Action,
    CreateGang,
    Decision,
    DeleteGang,
    Event,
    Observed,
    ReplicaObservation,
    RequeueAfter,
)
from seqtrain_operator.planner.types import Unschedulable

# How often to look again while waiting for capacity or for a dying gang to disappear.
POLL_SECONDS = 5.0
MAX_CAPACITY_POLL_SECONDS = 60.0
# Scheduled condition reason of a native gang created unpinned for the node autoscaler (gang_policy.autoscales).
SCALE_UP = "ScaleUpRequested"
# When a node dies its pods' peers often fail first (a reset connection) while the dead node still looks Ready (the
# node controller marks it NotReady only after its monitor grace period). Charging that echo to the user would use up
# the wrong budget and avoid the wrong node: a user-class failure is acted on only after this long, or at once when
# nothing of the gang runs any more; a replica on a NotReady node is waited for until it is lost or back.
FAILURE_SETTLE_SECONDS = 15.0
# Placed replicas still starting this long (a large image pull, a volume attach) get the Starting condition. A
# quicker start is not worth a status write: a burst of 8000 pods takes the kubelets (kwok on two cores) more than
# 10 s, and every gang of the 1000-job run then cost one more write.
SLOW_START_SECONDS = 30.0
# An elastic gang running below its size grows back only after running this long at the smaller one.
ELASTIC_GROW_AFTER_SECONDS = 30.0


@dataclass
class _Ctx:
    job: SeqTrainJob
    st: JobStatus
    observed: Observed
    now: datetime
    actions: list[Action] = field(default_factory=list)

    @property
    def gang_job(self) -> SeqTrainJob:
        """The job as the live attempt runs it (an elastic gang may run fewer than spec.replicas)."""
        return self.job.with_replicas(self.st.replicas or self.job.spec.replicas)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.actions.append(Event(type_, reason, message))  # type: ignore[arg-type]

    def delete(self, attempt: int, reason: str) -> None:
        """Delete every replica of `attempt`; force it on nodes that are lost (see DeleteGang.force_nodes), and where
        a replica is overdue in Terminating on a Ready node (said in the Terminating condition and an Event)."""
        mine = [r for r in self.observed.replicas if r.attempt == attempt and r.node]
        overdue = sorted({r.node for r in mine if r.overdue and r.node})
        lost = sorted({r.node for r in mine if r.node_lost and r.node} | set(overdue))
        self.actions.append(DeleteGang(attempt, reason, tuple(lost)))
        if overdue:
            replicas = ", ".join(str(r.replica) for r in mine if r.overdue)
            msg = (f"attempt {attempt}: replica(s) {replicas} still terminating on Ready node(s) {', '.join(overdue)} "
                   f"past their grace period (the kubelet did not confirm): force-deleted")
            prev = cond.get(self.st, "Terminating")
            if prev is None or prev.message != msg:
                cond.set_condition(self.st, "Terminating", "True", "TerminationOverdue", msg, self.now)
                self.event("Warning", "ForceDeleted", msg)


def decide(job: SeqTrainJob, status: JobStatus, observed: Observed, now: datetime) -> Decision:
    """Decide what the backend must do next.

    job: the validated SeqTrainJob (spec.replicas, spec.faultTolerance, spec.scheduling, spec.suspend are read).
    status: the last persisted status (JobStatus() for a new job). Never mutated.
    observed: the gang and checkpoints as seen now (see `Observed`).
    now: the current time (timezone-aware, UTC); the only clock the core uses.

    Returns Decision(actions, status): execute the actions in order (events after the status write), then persist
    `status`. Action types: CreateGang(attempt, resume_from_step, avoid_nodes), DeleteGang(attempt, reason),
    RequeueAfter(seconds), Event(type, reason, message).
    """
    ctx = _Ctx(job, status.model_copy(deep=True), observed, now)
    st = ctx.st
    if st.replicas is None:
        st.replicas = job.spec.replicas
    st.world_size = ctx.gang_job.spec.world_size
    if observed.generation is not None:
        st.observed_generation = observed.generation
    _record_progress(ctx)
    _record_divergence(ctx)
    _record_skipped_checkpoints(ctx)
    _prune_failed_nodes(ctx)

    gv = gang_policy.view(observed, st.attempt)
    for stale in gv.stale:
        ctx.delete(stale, "StaleIncarnation")

    if st.phase in TERMINAL_PHASES:
        # Terminal phases stay terminal; only stop replicas that still run (e.g. a rank hanging after a peer failed).
        if any(r.phase in ("Pending", "Running") for r in gv.current):
            ctx.delete(st.attempt, f"Job{st.phase}")
    elif job.spec.suspend:
        _suspend(ctx, gv.current)
    elif gv.current:
        _live_gang(ctx, gv.current, status.progress.step if status.progress else 0)
    else:
        _no_gang(ctx)
    # spec.ttlSecondsAfterFinished, from the pass that finished the job on: a finished job is not polled, so the
    # pass that finishes it must ask for the one at its TTL (nothing else may wake it).
    ctx.actions += expire(job, st, now)
    lost_time.account(status, st, parse(observed.created), now)
    goodput.account(status, st, now)
    return Decision(tuple(ctx.actions), st)


# ---- observation bookkeeping ---------------------------------------------------------------------------------------


def _record_progress(ctx: _Ctx) -> None:
    st, obs = ctx.st, ctx.observed
    total = ctx.job.spec.training.steps
    if obs.progress is not None:
        p = obs.progress.model_copy()
        p.total_steps = total
        st.progress = p
    elif st.progress is None:
        st.progress = Progress(step=0, total_steps=total)
    if obs.latest_checkpoint is not None:
        st.last_checkpoint = obs.latest_checkpoint.model_copy()
    p = obs.progress
    if p is not None and p.attempt == st.attempt and st.attempt > 1 and not p.restart_round and st.steps_lost and \
            p.step_reached_before is not None and p.resumed_from is not None:
        # The attempt after a failure says what it redoes (the failure's pass counted from the checkpoint it knew
        # then; a SIGTERM save published after it, which the operator may learn only now, leaves fewer).
        st.steps_lost[-1] = min(st.steps_lost[-1], max(0, p.step_reached_before - p.resumed_from))
    checkpoint_policy.record(st, obs.checkpoint_policy, obs.work_at_risk, ctx.now)


def _record_divergence(ctx: _Ctx) -> None:
    """Diverging=True (with one Warning event) when rank 0 reports a step whose loss was not a finite number (the
    progress reader's lossNonFinite: NaN, Infinity, beyond 1e9), False once a finite loss is reported again. Set on
    the transition only, so a diverging run costs no status write per pass. The job goes on: stopping is the user's
    call (a loss scaler skips such steps, a run may recover)."""
    p = ctx.observed.progress
    if p is None:
        return
    prev = cond.get(ctx.st, "Diverging")
    if p.loss_non_finite and (prev is None or prev.status != "True"):
        msg = (f"step {p.step}: the training loss is not a finite number (NaN or Infinity); "
               "status.progress.nonFiniteSteps counts such steps")
        cond.set_condition(ctx.st, "Diverging", "True", "NonFiniteLoss", msg, ctx.now)
        ctx.event("Warning", "NonFiniteLoss", msg)
    elif not p.loss_non_finite and p.loss is not None and prev is not None and prev.status == "True":
        cond.set_condition(ctx.st, "Diverging", "False", "FiniteLoss", f"step {p.step}: the loss is finite again",
                           ctx.now)


def _record_skipped_checkpoints(ctx: _Ctx) -> None:
    for step, reason in ctx.observed.skipped_checkpoints:
        if str(step) not in ctx.st.skipped_checkpoints:
            ctx.st.skipped_checkpoints[str(step)] = reason
            ctx.event("Warning", "CheckpointSkipped", f"checkpoint step {step} set aside, resumed from an earlier "
                      f"one: {reason}")


def _prune_failed_nodes(ctx: _Ctx) -> None:
    keep = {}
    for node, until in ctx.st.failed_nodes.items():
        t = parse(until)
        if t is not None and t > ctx.now:
            keep[node] = until
    ctx.st.failed_nodes = keep


def _placement(ctx: _Ctx, current: tuple[ReplicaObservation, ...]) -> None:
    """Where the replicas are: the node each pod is bound to; a replica not bound yet keeps its planned node, and
    an entry keeps the topology domain the plan recorded while the pod is on the planned node."""
    procs = ctx.job.spec.resources.procs
    planned = {p.replica: p for p in ctx.st.placement}
    out = {}
    for r in sorted(current, key=lambda r: r.replica):
        if not r.node:
            continue
        old = planned.get(r.replica)
        out[r.replica] = ReplicaPlacement(replica=r.replica, node=r.node,
                                          ranks=list(range(r.replica * procs, (r.replica + 1) * procs)),
                                          domain=list(old.domain) if old is not None and old.node == r.node else [])
    for replica, p in planned.items():
        out.setdefault(replica, p)
    ctx.st.placement = [out[r] for r in sorted(out)]


# ---- the three situations -------------------------------------------------------------------------------------------


def _suspend(ctx: _Ctx, current: tuple[ReplicaObservation, ...]) -> None:
    st = ctx.st
    if current:
        # Graceful delete: the trainer saves a checkpoint on SIGTERM, so resuming loses at most the current step.
        ctx.delete(st.attempt, "Suspended")
    if st.phase != "Suspended":
        cond.enter_phase(st, "Suspended", "Suspended", "spec.suspend is true: gang stopped; set it to false to resume",
                         ctx.now)
        st.next_restart_time = None
        ctx.event("Normal", "Suspended", "gang stopped (spec.suspend)")


def _live_gang(ctx: _Ctx, current: tuple[ReplicaObservation, ...], status_step: int) -> None:
    st, job = ctx.st, ctx.job
    if st.phase in ("Restarting", "Suspended") or _tearing_down(st):
        # We already decided to tear this gang down (or Ctrl-C/suspend left it dying): keep deleting, then wait.
        # Its replicas now fail or vanish because WE asked: that is never a failure to charge (nor a node to avoid).
        ctx.delete(st.attempt, "TearingDown")
        _partitioned(ctx, current)
        ctx.actions.append(RequeueAfter(POLL_SECONDS))
        return
    _placement(ctx, current)
    _count_in_place(ctx, status_step)
    gang = ctx.gang_job
    phase = gang_policy.gang_phase(gang, current)
    if phase == "Failed":
        failure = root_cause(current)
        assert failure is not None
        if failure.cls is FailureClass.USER and (wait := _settling(ctx, current)) is not None:
            ctx.actions.append(RequeueAfter(wait))
            return
        _on_failure(ctx, failure)
        return
    missing = gang_policy.missing(gang, current)
    if missing and st.phase == "Running":
        _on_failure(ctx, Failure(FailureClass.INFRASTRUCTURE, "Deleted",
                                 f"replica {missing[0]} disappeared while the gang was running"))
        return
    if phase == "Succeeded":
        p = st.progress
        if p is not None and p.stop_reason:  # the trainer ended early on purpose (e.g. EarlyStopped)
            cond.enter_phase(st, "Succeeded", p.stop_reason, f"stopped at step {p.step}: {p.stop_message or ''}",
                             ctx.now)
        else:
            cond.enter_phase(st, "Succeeded", "TrainingComplete", f"trained {job.spec.training.steps} steps", ctx.now)
        cond.set_condition(st, "Scheduled", "True", "GangRunning", "", ctx.now)
        st.completion_time = iso(ctx.now)
        st.next_restart_time = None
        ctx.event("Normal", "Succeeded", f"training finished after {st.restarts} restart(s)")
        return
    if phase == "Running":
        if st.phase != "Running":
            st.create_failures = 0
            cond.set_condition(st, "Scheduled", "True", "GangRunning", f"{len(current)} replica(s) running", ctx.now)
            if (c := cond.get(st, "Starting")) is not None and c.status == "True":
                cond.set_condition(st, "Starting", "False", "Started", f"attempt {st.attempt}: every replica started",
                                   ctx.now)
            cond.enter_phase(st, "Running", "GangRunning", f"attempt {st.attempt}: all replicas running", ctx.now)
            ctx.event("Normal", "Running", f"attempt {st.attempt}: all {len(current)} replica(s) running")
        hang = _hang(ctx)
        if hang is not None:
            _on_failure(ctx, hang)
        elif (grow := _growth(ctx)) is not None:
            _scale_up(ctx, grow)
        elif (limit := job.spec.fault_tolerance.hang_timeout_seconds) is not None:
            ctx.actions.append(RequeueAfter(float(limit)))
        return
    # Pending: admitted and created, waiting for every replica to start.
    if st.phase != "Scheduling":
        cond.enter_phase(st, "Scheduling", "GangCreated", f"attempt {st.attempt}: waiting for replicas", ctx.now)
    native = job.spec.scheduling.gang == "native"
    if not native and gang_policy.queued(gang, current):
        _queued(ctx, current)
        return
    if (c := cond.get(st, "Scheduled")) is not None and c.reason == "Queued":
        # Admitted by the queue just now: pendingGraceSeconds counts from here, not from when it was queued.
        cond.set_condition(st, "Scheduled", "False", "Admitted", f"attempt {st.attempt}: admitted, starting", ctx.now)
        c.last_transition_time = iso(ctx.now)
    created = parse((c := cond.get(st, "Scheduled")) and c.last_transition_time)
    scaling = c is not None and c.reason == SCALE_UP
    # Unpinned for the autoscaler: the wait for new nodes has its own, longer deadline.
    grace = job.spec.scheduling.autoscale_timeout_seconds if scaling else job.spec.scheduling.pending_grace_seconds
    waited = seconds_between(created, ctx.now) if created else 0.0
    pulling = [r for r in current if r.phase == "Pending" and r.reason in IMAGE_PULL_REASONS]
    if pulling:
        # A failing pull is transient (registry hiccups on a large image): its own deadline replaces the pending
        # grace, since tearing down and re-planning would only pull again from scratch.
        r, limit = pulling[0], job.spec.fault_tolerance.image_pull_timeout_seconds
        where = f"replica {r.replica}" + (f" on {r.node}" if r.node else "")
        if waited > limit:
            ctx.delete(st.attempt, r.reason or "ErrImagePull")
            _fail(ctx, r.reason or "ErrImagePull", f"{where} could not pull image {job.spec.image} for "
                  f"{waited:.0f}s (faultTolerance.imagePullTimeoutSeconds = {limit}): {r.message}")
            return
        st.message = f"attempt {st.attempt}: {where} is retrying the image pull ({r.reason}): {r.message}"[:1000]
        ctx.actions.append(RequeueAfter(max(1.0, min(POLL_SECONDS * 6, limit - waited))))
        return
    # Replicas still in kube-scheduler's queue (native gangs: not yet tried, not refused) are not stuck; a burst of
    # thousands of pods takes it a while. Stuck: refused by the scheduler (not placed on a node).
    stuck = [r for r in current if r.phase == "Pending" and not r.node and not (native and r.queued)]
    # Placed and starting (ContainerCreating: pulling a large image, attaching a volume) is progress, with a deadline
    # of its own: tearing it down would only start the pull or the attach again elsewhere.
    starting = [r for r in current if r.phase == "Pending" and r.node]
    start_limit = job.spec.scheduling.start_timeout_seconds
    if (waited > grace and stuck) or (waited > start_limit and starting):
        # A partly started gang holds resources others need: tear it down and re-plan from scratch.
        why, limit = ("PendingTimeout", grace) if waited > grace and stuck else ("StartTimeout", start_limit)
        what = ("still unschedulable" + (" (the autoscaler added no room for them)" if scaling else "")
                if why == "PendingTimeout" else "placed but not started")
        ctx.delete(st.attempt, why)
        cond.set_condition(st, "Scheduled", "False", why, f"replicas {what} after {limit}s; re-planning", ctx.now)
        ctx.event("Warning", why, f"attempt {st.attempt}: replicas {what} for {waited:.0f}s")
        st.phase = "Scheduling"
        return
    # Starting for how long: since the earliest placement (unknown: since the gang was created).
    placed = [seconds_between(t, ctx.now) if (t := parse(r.placed_at)) else waited for r in starting]
    slow = max(placed, default=0.0) >= SLOW_START_SECONDS
    prev = cond.get(st, "Starting")
    if starting and slow:
        r = starting[placed.index(max(placed))]
        if prev is None or prev.status != "True" or not prev.message.startswith(f"attempt {st.attempt}:"):
            # Said once per attempt: how long it has been is the condition's lastTransitionTime, not a message that
            # changes (a status write) every pass.
            cond.set_condition(st, "Starting", "True", "ContainerCreating",
                               f"attempt {st.attempt}: replica(s) placed and starting for over "
                               f"{SLOW_START_SECONDS:.0f}s (replica {r.replica} on {r.node}: pulling the image or "
                               f"attaching volumes); scheduling.startTimeoutSeconds = {start_limit}", ctx.now)
            cond.get(st, "Starting").last_transition_time = iso(ctx.now)  # type: ignore[union-attr]  # this attempt's
    elif not starting and prev is not None and prev.status == "True":
        cond.set_condition(st, "Starting", "False", "Started", f"attempt {st.attempt}: every placed replica started",
                           ctx.now)
    deadlines = (([grace - waited] if stuck else []) + ([start_limit - waited] if starting else [])
                 + ([SLOW_START_SECONDS - max(placed)] if starting and not slow else []))
    ctx.actions.append(RequeueAfter(max(1.0, min(deadlines + [POLL_SECONDS * 6]))))


def _partitioned(ctx: _Ctx, current: tuple[ReplicaObservation, ...]) -> None:
    """Replicas on unreachable nodes that nobody confirmed down may still run (a partition): their pods are never
    force-deleted on that evidence, so the next gang waits for them; say so, and how to end the wait."""
    nodes = sorted({r.node for r in current if r.reason == "NodeUnreachable" and r.node})
    if not nodes:
        return
    msg = (f"attempt {ctx.st.attempt}: waiting for the pods on unreachable node(s) {', '.join(nodes)}, which may "
           f"still run (a network partition) and are never force-deleted on that evidence; once a node is known to "
           f"be down, taint it node.kubernetes.io/out-of-service=nodeshutdown:NoExecute (or delete the Node)")
    prev = cond.get(ctx.st, "NodeUnreachable")
    if prev is None or prev.status != "True" or prev.message != msg:
        cond.set_condition(ctx.st, "NodeUnreachable", "True", "AwaitingOutOfService", msg, ctx.now)
        ctx.event("Warning", "NodeUnreachable", msg)


def _settling(ctx: _Ctx, current: tuple[ReplicaObservation, ...]) -> float | None:
    """Seconds to wait before charging a user-class failure, or None to act now (see FAILURE_SETTLE_SECONDS)."""
    alive = [r for r in current if r.phase in ("Pending", "Running")]
    if not alive:
        return None
    if any(r.node_unready for r in alive):
        return POLL_SECONDS  # lost (infrastructure) or back (then the failure is the user's) soon
    ends = [t for r in current if r.phase == "Failed" and (t := parse(r.finished_at)) is not None]
    if not ends:
        return None
    left = FAILURE_SETTLE_SECONDS - seconds_between(min(ends), ctx.now)
    return max(1.0, left) if left > 0 else None


def _tearing_down(st: JobStatus) -> bool:
    """The operator itself gave up the live attempt without a failure (pending timeout: re-plan; the API server
    refused part of the gang)."""
    c = cond.get(st, "Scheduled")
    return st.phase == "Scheduling" and c is not None and c.reason in ("PendingTimeout", "StartTimeout",
                                                                       "CreateFailed")


def _queued(ctx: _Ctx, current: tuple[ReplicaObservation, ...]) -> None:
    """The whole gang waits in an external scheduler's queue: keep it (tearing it down would lose its place)."""
    st, queue = ctx.st, ctx.job.spec.scheduling.queue
    prev = cond.get(st, "Scheduled")
    where = f"queue {queue}" if queue else f"the {ctx.job.spec.scheduling.gang} scheduler"
    msg = f"attempt {st.attempt}: all {len(current)} replica(s) waiting in {where}"
    if prev is None or prev.reason != "Queued":
        cond.set_condition(st, "Scheduled", "False", "Queued", msg, ctx.now)
        ctx.event("Normal", "Queued", msg)
    st.message = msg
    ctx.actions.append(RequeueAfter(POLL_SECONDS))


def _hang(ctx: _Ctx) -> Failure | None:
    limit = ctx.job.spec.fault_tolerance.hang_timeout_seconds
    if limit is None:
        return None
    last = parse(ctx.st.progress.updated_at if ctx.st.progress else None)
    running = cond.get(ctx.st, "Running")
    since = parse(running.last_transition_time if running else None)
    # A step from an earlier attempt does not count: the new gang gets the full limit from when it started running.
    ref = max((t for t in (last, since) if t is not None), default=None)
    if ref is None:
        return None
    idle = seconds_between(ref, ctx.now)
    unreachable = ctx.observed.progress_unreachable
    if unreachable:
        # No progress seen because it cannot be read, not because training stopped: never fail a job on that.
        prev = cond.get(ctx.st, "Progressing")
        if idle > limit and (prev is None or prev.status != "Unknown"):
            msg = (f"no progress seen for {idle:.0f}s, but the progress endpoint is unreachable ({unreachable}); "
                   f"hang detection (faultTolerance.hangTimeoutSeconds) is paused until it answers")
            cond.set_condition(ctx.st, "Progressing", "Unknown", "ProgressUnknown", msg, ctx.now)
            ctx.event("Warning", "ProgressUnknown", msg)
        return None
    if idle > limit:
        return hang_failure(idle, limit)
    if ctx.observed.progress is not None:
        source = ctx.observed.progress_source
        cond.set_condition(ctx.st, "Progressing", "True", "StepsCompleting",
                           f"progress {source} {'by' if source == 'pushed' else 'from'} rank 0" if source else "",
                           ctx.now)
    return None


def _no_gang(ctx: _Ctx) -> None:
    st, job, obs = ctx.st, ctx.job, ctx.observed
    if not gang_policy.may_create(obs):
        ctx.actions.append(RequeueAfter(POLL_SECONDS))  # stale replicas still dying
        return
    if st.phase == "Running":
        _on_failure(ctx, Failure(FailureClass.INFRASTRUCTURE, "Deleted", "the gang disappeared while running"))
        return
    scheduled = cond.get(st, "Scheduled")
    if st.phase == "Restarting" or (scheduled is not None and scheduled.reason == "CreateFailed"):
        due = parse(st.next_restart_time)
        if due is not None and due > ctx.now:
            ctx.actions.append(RequeueAfter(seconds_between(ctx.now, due)))
            return
    if (st.phase == "Scheduling" and scheduled is not None and scheduled.reason in ("GangCreated", SCALE_UP)
            and st.attempt > 0):
        # Created but not observed yet (a lagging cache, or the create failed half-way): create what is absent,
        # on the nodes the status says it was planned on.
        plan = gang_policy.plan_of(ctx.gang_job, st.placement) if obs.capacity is not None else None
        ctx.actions.append(CreateGang(st.attempt, _resume_step(ctx), _avoid(ctx), plan, _size_override(ctx),
                                      _in_place_delays(ctx)))
        ctx.actions.append(RequeueAfter(POLL_SECONDS))
        return

    admitted = gang_policy.admit(job, obs, _avoid(ctx))
    if isinstance(admitted, Unschedulable):
        _unschedulable(ctx, admitted.reason)
        return
    restarting = st.phase == "Restarting"
    if restarting:
        _recount_steps_lost(st, _resume_step(ctx))
    before = st.replicas
    for kind in ("Terminating", "NodeUnreachable"):
        if (c := cond.get(st, kind)) is not None and c.status == "True":
            cond.set_condition(st, kind, "False", "Gone", "the earlier attempt's pods are gone", ctx.now)
    st.attempt += 1
    st.replicas = admitted.replicas
    st.world_size = ctx.gang_job.spec.world_size
    st.next_restart_time = None
    st.attempt_start_time = iso(ctx.now)
    st.restart_round = 0
    if st.start_time is None:
        st.start_time = iso(ctx.now)
    resume = _resume_step(ctx)
    ctx.actions.append(CreateGang(st.attempt, resume, _avoid(ctx), admitted.plan, _size_override(ctx),
                                  _in_place_delays(ctx)))
    st.placement = gang_policy.placement_of(admitted.plan) if admitted.plan is not None else []
    size = f"{admitted.replicas} of {job.spec.replicas}" if admitted.replicas < job.spec.replicas else \
        f"{admitted.replicas}"
    if admitted.scale_up:
        limit = job.spec.scheduling.autoscale_timeout_seconds
        cond.set_condition(st, "Scheduled", "False", SCALE_UP,
                           f"attempt {st.attempt}: the gang does not fit today's nodes ({admitted.short}); its {size} "
                           f"pods are created unpinned for the node autoscaler and must all be placed within "
                           f"{limit}s (scheduling.autoscaleTimeoutSeconds)"[:1000], ctx.now)
    else:
        cond.set_condition(st, "Scheduled", "False", "GangCreated",
                           f"attempt {st.attempt} created ({size} replicas)", ctx.now)
    # pendingGraceSeconds counts from here: the condition may have been False for long already (waiting for
    # capacity, a torn-down attempt), and that wait must not tear the new gang down before its pods could start.
    cond.get(st, "Scheduled").last_transition_time = iso(ctx.now)  # type: ignore[union-attr]
    where = f"from checkpoint step {resume}" if resume is not None else "from scratch"
    cond.enter_phase(st, "Scheduling", "GangCreated", f"attempt {st.attempt}: starting {size} replica(s) {where}",
                     ctx.now)
    if admitted.scale_up:
        ctx.event("Normal", SCALE_UP, f"attempt {st.attempt}: {size} replica(s) created unpinned for the node "
                  f"autoscaler: {admitted.short}"[:1000])
    if restarting:
        ctx.event("Normal", "Restarted", f"attempt {st.attempt}: gang of {size} replica(s) re-created {where} "
                  "(mode: re-created, new pods)")
    else:
        ctx.event("Normal", "GangCreated", f"attempt {st.attempt}: gang of {size} replica(s) created {where}")
    if admitted.replicas < job.spec.replicas:
        full, now_ = job.spec.grad_accum, ctx.gang_job.spec.grad_accum
        msg = (f"attempt {st.attempt}: elastic gang runs {admitted.replicas} of {job.spec.replicas} replicas "
               f"(spec.minReplicas {job.spec.min_replicas}) because the full gang does not fit: {admitted.short}; "
               f"global batch {job.spec.training.global_batch_size} kept ({now_} micro-batches per rank instead of "
               f"{full}); it grows back when capacity returns")
        st.message = msg[:1000]
        ctx.event("Warning", "ScaledDown", msg)
    elif before is not None and before < admitted.replicas and st.attempt > 1:
        ctx.event("Normal", "ScaledUp", f"attempt {st.attempt}: back to all {admitted.replicas} replicas "
                  f"(the previous attempt ran {before})")


def _unschedulable(ctx: _Ctx, reason: str) -> None:
    st, sched = ctx.st, ctx.job.spec.scheduling
    prev = cond.get(st, "Scheduled")
    first = prev is None or prev.reason != "Unschedulable"
    cond.set_condition(st, "Scheduled", "False", "Unschedulable", reason, ctx.now)
    if first:
        # A new wait starts now (the condition may have been False for another reason before).
        cur = cond.get(st, "Scheduled")
        assert cur is not None
        cur.last_transition_time = iso(ctx.now)
        ctx.event("Warning", "Unschedulable", reason)
    st.phase = "Scheduling"
    st.message = f"waiting for capacity: {reason}"
    since = parse(cond.get(st, "Scheduled").last_transition_time)  # type: ignore[union-attr]
    waited = seconds_between(since, ctx.now) if since else 0.0
    if sched.timeout_seconds is not None and waited > sched.timeout_seconds and sched.on_timeout == "fail":
        _fail(ctx, "SchedulingTimeout", f"gang could not be scheduled within {sched.timeout_seconds}s: {reason}")
        return
    # Looking again costs the backend a cluster-wide read; the longer the wait, the rarer the look (node changes
    # wake the job at once anyway).
    ctx.actions.append(RequeueAfter(min(MAX_CAPACITY_POLL_SECONDS, max(POLL_SECONDS, waited / 4))))


def create_failed(job: SeqTrainJob, status: JobStatus, attempt: int, message: str, now: datetime) -> Decision:
    """The API server refused part of gang `attempt` while the backend created it (a 403 from a ResourceQuota, a
    422 from an admission plugin): tear down what was created (never leave a partial gang), say why with the API's
    own message in the Scheduled condition and an Event, and try again after a backoff. Not a training failure:
    no restart budget is charged."""
    ctx = _Ctx(job, status.model_copy(deep=True), Observed(), now)
    st = ctx.st
    st.create_failures += 1
    delay = backoff_seconds(job.spec.fault_tolerance, st.create_failures)
    st.next_restart_time = iso(now + timedelta(seconds=delay))
    msg = f"attempt {attempt}: the API server refused the gang: {message}; torn down, retrying in {delay:g}s"[:1000]
    cond.set_condition(st, "Scheduled", "False", "CreateFailed", msg, now)
    st.phase = "Scheduling"
    st.message = msg
    st.placement = []
    ctx.actions.append(DeleteGang(attempt, "CreateFailed"))
    ctx.actions.append(RequeueAfter(delay))
    ctx.event("Warning", "CreateFailed", msg)
    return Decision(tuple(ctx.actions), st)


def _size_override(ctx: _Ctx) -> int | None:
    """CreateGang.replicas: the attempt's size when it is not spec.replicas (an elastic gang running smaller)."""
    return ctx.st.replicas if ctx.st.replicas != ctx.job.spec.replicas else None


def _growth(ctx: _Ctx) -> gang_policy.Admitted | None:
    """A larger size the elastic gang fits at now, once it has run at its current size for a while (a node that
    flaps must not rescale the gang back and forth)."""
    st = ctx.st
    running = cond.get(st, "Running")
    since = parse(running.last_transition_time if running else None)
    if not ctx.job.spec.elastic or since is None or seconds_between(since, ctx.now) < ELASTIC_GROW_AFTER_SECONDS:
        return None
    return gang_policy.growth(ctx.job, st.replicas or ctx.job.spec.replicas, ctx.observed, _avoid(ctx))


def _scale_up(ctx: _Ctx, grow: gang_policy.Admitted) -> None:
    """Capacity is back: stop the smaller gang gracefully (the trainer checkpoints on SIGTERM, so nothing is lost)
    and start the larger one at once. Not a failure: no budget is charged and no node avoided."""
    st = ctx.st
    ctx.delete(st.attempt, "ScalingUp")
    msg = (f"attempt {st.attempt}: {grow.replicas} of {ctx.job.spec.replicas} replicas fit again (running "
           f"{st.replicas}): checkpointing and restarting the gang at {grow.replicas}")
    cond.enter_phase(st, "Restarting", "ScalingUp", msg, ctx.now)
    st.next_restart_time = iso(ctx.now)
    ctx.event("Normal", "ScalingUp", msg)
    ctx.actions.append(RequeueAfter(POLL_SECONDS))


def _in_place_delays(ctx: _Ctx) -> tuple[float, ...]:
    """The backoff of each in-place restart the new gang's launchers may make: faultTolerance.inPlaceRestarts, at
    most the restart budget left, each delayed as the restart it is counted as would be (backoff_seconds)."""
    st, ft = ctx.st, ctx.job.spec.fault_tolerance
    n = max(0, min(ft.in_place_restarts, ft.max_restarts - st.restarts))
    return tuple(backoff_seconds(ft, st.restarts + st.infra_restarts + k) for k in range(1, n + 1))


def _count_in_place(ctx: _Ctx, step_before: int) -> None:
    """Charge the in-place restarts the live gang's launchers made (rank 0's progress reports its round): each
    counts in status.restarts like a re-created gang, with an Event naming the mode. Level-based: the status
    records the round counted, so a repeated observation charges nothing."""
    st, p = ctx.st, ctx.observed.progress
    seen = [r.restart_round for r in ctx.observed.replicas if r.attempt == st.attempt]
    if p is not None and p.attempt == st.attempt and p.restart_round is not None:
        seen.append(p.restart_round)
    rnd = max(seen, default=0)
    if rnd <= st.restart_round:
        return
    ft = ctx.job.spec.fault_tolerance
    new = rnd - st.restart_round
    st.restart_round = rnd
    st.in_place_restarts += new
    st.restarts = min(ft.max_restarts, st.restarts + new)
    ck = _resume_step(ctx)
    if p is not None and p.attempt == st.attempt and p.step_reached_before is not None:
        # the ranks' own record: the old round's last steps may have come and gone between two observations
        step_before = max(step_before, p.step_reached_before)
    st.steps_lost.append(max(0, step_before - (ck or 0)))
    msg = (f"attempt {st.attempt}: ranks restarted in place (round {rnd}, mode: in-place, same pods) "
           f"from checkpoint step {ck if ck is not None else 'none'}; restart {st.restarts}/{ft.max_restarts}")
    st.message = msg
    ctx.event("Warning", "RestartedInPlace", msg)


def _recount_steps_lost(st: JobStatus, resume: int | None) -> None:
    """The steps the new attempt redoes, as of the checkpoint it resumes from: a checkpoint published after the
    failure was seen (an evicted gang's SIGTERM save, written in its grace period) leaves fewer than the failure's
    pass counted from the checkpoint before it. Called before the attempt moves on: `st.progress` is the old one's."""
    p = st.progress
    if resume is None or not st.steps_lost or p is None or (p.attempt is not None and p.attempt != st.attempt):
        return
    st.steps_lost[-1] = min(st.steps_lost[-1], max(0, p.step - resume))


def _resume_step(ctx: _Ctx) -> int | None:
    ck = ctx.observed.latest_checkpoint or ctx.st.last_checkpoint
    return ck.step if ck is not None else None


def _avoid(ctx: _Ctx) -> tuple[str, ...]:
    return tuple(sorted(ctx.st.failed_nodes))


# ---- failures ------------------------------------------------------------------------------------------------------


def _on_failure(ctx: _Ctx, failure: Failure) -> None:
    st, ft = ctx.st, ctx.job.spec.fault_tolerance
    ctx.delete(st.attempt, failure.reason)
    done = st.progress.step if st.progress else 0
    ck = _resume_step(ctx) or 0
    if failure.cls is FailureClass.PERMANENT:
        _fail(ctx, failure.reason, f"{failure.message}; not restarting (permanent failure)")
        return
    if failure.cls is FailureClass.INFRASTRUCTURE:
        if st.infra_restarts >= ft.max_infra_restarts:
            _fail(ctx, failure.reason, f"{failure.message}; faultTolerance.maxInfraRestarts "
                  f"({ft.max_infra_restarts}) reached")
            return
        st.infra_restarts += 1
        if failure.node:
            st.failed_nodes[failure.node] = iso(ctx.now + timedelta(seconds=ft.node_avoid_seconds))
    elif failure.cls is FailureClass.DISRUPTION:
        pass  # the cluster's choice, on a healthy node: no budget spent, no node avoided
    else:
        if _repeated_startup_failure(ctx, failure):
            said = "" if failure.error is None or failure.error in failure.message else f" ({failure.error})"
            _fail(ctx, "StartupFailure", f"{failure.message}{said}; attempts {st.attempt - 1} and {st.attempt} "
                  "failed the same way before their first step (a deterministic start-up failure): not restarting; "
                  "fix the cause in the rank log and resubmit")
            return
        if st.restarts >= ft.max_restarts:
            _fail(ctx, failure.reason, f"{failure.message}; faultTolerance.maxRestarts ({ft.max_restarts}) reached")
            return
        st.restarts += 1
    delay = backoff_seconds(ft, st.restarts + st.infra_restarts)
    st.steps_lost.append(max(0, done - ck))
    st.next_restart_time = iso(ctx.now + timedelta(seconds=delay))
    count = f"restart {st.restarts}/{ft.max_restarts}" if failure.cls is FailureClass.USER else \
        "restart (a disruption: not counted)" if failure.cls is FailureClass.DISRUPTION else \
        f"infrastructure restart {st.infra_restarts}/{ft.max_infra_restarts}"
    msg = f"{failure.message}; {count} in {delay:g}s from checkpoint step {ck or 'none'}"
    cond.enter_phase(st, "Restarting", failure.reason, msg, ctx.now)
    ctx.actions.append(RequeueAfter(delay))
    ctx.event("Warning", failure.reason, msg)


def _repeated_startup_failure(ctx: _Ctx, failure: Failure) -> bool:
    """True when this attempt failed before its first step with the signature the previous attempt failed with
    before its first step. The first such failure is retried (it may have been a blip); an identical second is not:
    restarting from the same checkpoint with the same config would only burn the budget. Records the signature."""
    st = ctx.st
    started = parse(st.attempt_start_time)
    last_step = parse(st.progress.updated_at if st.progress else None)
    # updatedAt has whole seconds: a step stamped in the attempt's first second still counts as a step.
    stepped = started is None or (last_step is not None and last_step >= started.replace(microsecond=0))
    if failure.signature is None or stepped:
        st.startup_failure = None
        return False
    if st.startup_failure == failure.signature:
        return True
    st.startup_failure = failure.signature
    return False


def _fail(ctx: _Ctx, reason: str, message: str) -> None:
    st = ctx.st
    cond.enter_phase(st, "Failed", reason, message, ctx.now)
    st.completion_time = iso(ctx.now)
    st.next_restart_time = None
    ctx.event("Warning", "Failed", message)
