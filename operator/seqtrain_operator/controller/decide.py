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

from datetime import datetime

from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import TERMINAL_PHASES, JobStatus, Progress, ReplicaPlacement
from seqtrain_operator.controller import checkpoint_policy, gang_policy, goodput, lost_time
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller.absent import create_failed, no_gang
from seqtrain_operator.controller.clock import parse
from seqtrain_operator.controller.context import POLL_SECONDS, SCALE_UP, Pass, resume_step, resumes
from seqtrain_operator.controller.failed import FAILURE_SETTLE_SECONDS, gang_failed, on_failure
from seqtrain_operator.controller.failure_policy import Failure, FailureClass
from seqtrain_operator.controller.pending import SLOW_START_SECONDS, gang_pending
from seqtrain_operator.controller.running import ELASTIC_GROW_AFTER_SECONDS, gang_running
from seqtrain_operator.controller.succeeded import gang_succeeded
from seqtrain_operator.controller.ttl import expire
from seqtrain_operator.controller.types import Decision, Observed, ReplicaObservation, RequeueAfter

__all__ = ["ELASTIC_GROW_AFTER_SECONDS", "FAILURE_SETTLE_SECONDS", "POLL_SECONDS", "SCALE_UP", "SLOW_START_SECONDS",
           "create_failed", "decide"]


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
    ctx = Pass(job, status.model_copy(deep=True), observed, now)
    st = ctx.st
    if st.replicas is None:
        st.replicas = job.spec.replicas
    st.world_size = ctx.gang_job.spec.world_size
    if observed.generation is not None:
        st.observed_generation = observed.generation
    _record_progress(ctx)
    _record_resume(ctx)
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
        no_gang(ctx)
    # spec.ttlSecondsAfterFinished, from the pass that finished the job on: a finished job is not polled, so the
    # pass that finishes it must ask for the one at its TTL (nothing else may wake it).
    ctx.actions += expire(job, st, now)
    lost_time.account(status, st, parse(observed.created), now)
    goodput.account(status, st, now)
    return Decision(tuple(ctx.actions), st)


def _live_gang(ctx: Pass, current: tuple[ReplicaObservation, ...], status_step: int) -> None:
    """The live attempt's gang exists: one policy per state of it (failed.py, succeeded.py, running.py,
    pending.py), unless the core is already tearing it down."""
    st = ctx.st
    if st.phase in ("Restarting", "Suspended") or _tearing_down(st):
        _await_teardown(ctx, current)
        return
    _placement(ctx, current)
    _count_in_place(ctx, status_step)
    gang = ctx.gang_job
    phase = gang_policy.gang_phase(gang, current)
    missing = gang_policy.missing(gang, current)
    if phase == "Failed":
        gang_failed(ctx, current)
    elif missing and st.phase == "Running":
        on_failure(ctx, Failure(FailureClass.INFRASTRUCTURE, "Deleted",
                                f"replica {missing[0]} disappeared while the gang was running"))
    elif phase == "Succeeded":
        gang_succeeded(ctx)
    elif phase == "Running":
        gang_running(ctx, current)
    else:
        gang_pending(ctx, current)


# ---- observation bookkeeping ---------------------------------------------------------------------------------------



def _record_progress(ctx: Pass) -> None:
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


def _record_resume(ctx: Pass) -> None:
    """Where the live attempt's trainer started, once it says so (its progress from the start of training:
    resumedFrom): the Resumed condition, and one event per attempt (and in-place round). Said for every restart and
    for a first attempt that resumed (a job re-applied over its checkpoints): the restart's own event could name only
    the checkpoint reported before the failure (context.resumes); this is the trainer's word. Level-based: the
    condition's message records what was said."""
    p, st = ctx.observed.progress, ctx.st
    if p is None or p.attempt != st.attempt or p.training_started_at is None:
        return
    if p.resumed_from is None and st.attempt <= 1 and not p.restart_round:
        return
    when = f"attempt {st.attempt}" + (f" round {p.restart_round}" if p.restart_round else "")
    if p.resumed_from is not None:
        value, reason, kind = "True", "Resumed", "Normal"
        msg = f"{when}: the trainer resumed from checkpoint step {p.resumed_from}"
    else:
        value, reason, kind = "False", "StartedFromScratch", "Warning"
        msg = f"{when}: the trainer found no complete checkpoint and started from step 0"
    prev = cond.get(st, "Resumed")
    if prev is not None and prev.message == msg:
        return
    cond.set_condition(st, "Resumed", value, reason, msg, ctx.now)
    ctx.event(kind, reason, msg)


def _record_divergence(ctx: Pass) -> None:
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


def _record_skipped_checkpoints(ctx: Pass) -> None:
    for step, reason in ctx.observed.skipped_checkpoints:
        if str(step) not in ctx.st.skipped_checkpoints:
            ctx.st.skipped_checkpoints[str(step)] = reason
            ctx.event("Warning", "CheckpointSkipped", f"checkpoint step {step} set aside, resumed from an earlier "
                      f"one: {reason}")


def _prune_failed_nodes(ctx: Pass) -> None:
    keep = {}
    for node, until in ctx.st.failed_nodes.items():
        t = parse(until)
        if t is not None and t > ctx.now:
            keep[node] = until
    ctx.st.failed_nodes = keep


def _placement(ctx: Pass, current: tuple[ReplicaObservation, ...]) -> None:
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



# ---- the core's own teardowns, and restarts in place ---------------------------------------------------------------


def _suspend(ctx: Pass, current: tuple[ReplicaObservation, ...]) -> None:
    st = ctx.st
    if current:
        # Graceful delete: the trainer saves a checkpoint on SIGTERM, so resuming loses at most the current step.
        ctx.delete(st.attempt, "Suspended")
    if st.phase != "Suspended":
        cond.enter_phase(st, "Suspended", "Suspended", "spec.suspend is true: gang stopped; set it to false to resume",
                         ctx.now)
        st.next_restart_time = None
        ctx.event("Normal", "Suspended", "gang stopped (spec.suspend)")



def _await_teardown(ctx: Pass, current: tuple[ReplicaObservation, ...]) -> None:
    """The core already decided to tear this gang down (or Ctrl-C/suspend left it dying): keep deleting, then wait.
    Its replicas now fail or vanish because the core asked: that is never a failure to charge (nor a node to
    avoid)."""
    ctx.delete(ctx.st.attempt, "TearingDown")
    _partitioned(ctx, current)
    ctx.actions.append(RequeueAfter(POLL_SECONDS))


def _partitioned(ctx: Pass, current: tuple[ReplicaObservation, ...]) -> None:
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


def _tearing_down(st: JobStatus) -> bool:
    """The operator itself gave up the live attempt without a failure (pending timeout: re-plan; the API server
    refused part of the gang)."""
    c = cond.get(st, "Scheduled")
    return st.phase == "Scheduling" and c is not None and c.reason in ("PendingTimeout", "StartTimeout",
                                                                       "CreateFailed")


def _count_in_place(ctx: Pass, step_before: int) -> None:
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
    ck = resume_step(ctx)
    if p is not None and p.attempt == st.attempt and p.step_reached_before is not None:
        # the ranks' own record: the old round's last steps may have come and gone between two observations
        step_before = max(step_before, p.step_reached_before)
    st.steps_lost.append(max(0, step_before - (ck or 0)))
    msg = (f"attempt {st.attempt}: ranks restarted in place (round {rnd}, mode: in-place, same pods) "
           f"{resumes(ck)}; restart {st.restarts}/{ft.max_restarts}")
    st.message = msg
    ctx.event("Warning", "RestartedInPlace", msg)

