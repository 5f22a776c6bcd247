"""No gang of the current attempt exists: wait (for a dying one to go, for the restart backoff), create what a
lagging cache does not show yet, or admit and create the next attempt's gang (gang_policy.admit: whole, or an
elastic gang smaller); a gang that cannot be placed waits for capacity (scheduling.timeoutSeconds)."""

from __future__ import annotations

from datetime import datetime, timedelta

from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import JobStatus
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller import gang_policy
from seqtrain_operator.controller.backoff import backoff_seconds
from seqtrain_operator.controller.clock import iso, parse, seconds_between
from seqtrain_operator.controller.context import (
    POLL_SECONDS,
    SCALE_UP,
    Pass,
    avoid,
    fail,
    in_place_delays,
    resume_step,
    resumes,
    size_override,
)
from seqtrain_operator.controller.failed import on_failure
from seqtrain_operator.controller.failure_policy import Failure, FailureClass
from seqtrain_operator.controller.types import CreateGang, Decision, DeleteGang, Observed, RequeueAfter
from seqtrain_operator.planner.types import Unschedulable

# Waiting for capacity, the core looks again at most this far apart (node changes wake the job at once anyway).
MAX_CAPACITY_POLL_SECONDS = 60.0


def no_gang(ctx: Pass) -> None:
    st, obs = ctx.st, ctx.observed
    if not gang_policy.may_create(obs):
        ctx.actions.append(RequeueAfter(POLL_SECONDS))  # stale replicas still dying
        return
    if st.phase == "Running":
        on_failure(ctx, Failure(FailureClass.INFRASTRUCTURE, "Deleted", "the gang disappeared while running"))
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
        ctx.actions.append(CreateGang(st.attempt, resume_step(ctx), avoid(ctx), plan, size_override(ctx),
                                      in_place_delays(ctx)))
        ctx.actions.append(RequeueAfter(POLL_SECONDS))
        return
    admitted = gang_policy.admit(ctx.job, obs, avoid(ctx))
    if isinstance(admitted, Unschedulable):
        unschedulable(ctx, admitted.reason)
        return
    create_gang(ctx, admitted)


def create_gang(ctx: Pass, admitted: gang_policy.Admitted) -> None:
    """The next attempt: its CreateGang, the status that says it was created (and from where it resumes), and the
    events (created or re-created, unpinned for the autoscaler, smaller or back to full size)."""
    st, job = ctx.st, ctx.job
    restarting = st.phase == "Restarting"
    if restarting:
        recount_steps_lost(st, resume_step(ctx))
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
    resume = resume_step(ctx)
    ctx.actions.append(CreateGang(st.attempt, resume, avoid(ctx), admitted.plan, size_override(ctx),
                                  in_place_delays(ctx)))
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
    # A first gang with no checkpoint known starts where the ranks find one (usually nowhere): said by the Resumed
    # condition once they report, not guessed here; a re-created gang always says what the core knows.
    where = resumes(resume) if resume is not None or restarting else ""
    cond.enter_phase(st, "Scheduling", "GangCreated",
                     f"attempt {st.attempt}: starting {size} replica(s) {where}".rstrip(), ctx.now)
    if admitted.scale_up:
        ctx.event("Normal", SCALE_UP, f"attempt {st.attempt}: {size} replica(s) created unpinned for the node "
                  f"autoscaler: {admitted.short}"[:1000])
    if restarting:
        ctx.event("Normal", "Restarted", f"attempt {st.attempt}: gang of {size} replica(s) re-created {where} "
                  "(mode: re-created, new pods)")
    else:
        ctx.event("Normal", "GangCreated", f"attempt {st.attempt}: gang of {size} replica(s) created {where}".rstrip())
    _resized(ctx, admitted, before)


def _resized(ctx: Pass, admitted: gang_policy.Admitted, before: int | None) -> None:
    """An elastic gang admitted below its size (a Warning, the batch kept), or back to full size."""
    st, job = ctx.st, ctx.job
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


def unschedulable(ctx: Pass, reason: str) -> None:
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
        fail(ctx, "SchedulingTimeout", f"gang could not be scheduled within {sched.timeout_seconds}s: {reason}")
        return
    # Looking again costs the backend a cluster-wide read; the longer the wait, the rarer the look (node changes
    # wake the job at once anyway).
    ctx.actions.append(RequeueAfter(min(MAX_CAPACITY_POLL_SECONDS, max(POLL_SECONDS, waited / 4))))


def create_failed(job: SeqTrainJob, status: JobStatus, attempt: int, message: str, now: datetime) -> Decision:
    """The API server refused part of gang `attempt` while the backend created it (a 403 from a ResourceQuota, a
    422 from an admission plugin): tear down what was created (never leave a partial gang), say why with the API's
    own message in the Scheduled condition and an Event, and try again after a backoff. Not a training failure:
    no restart budget is charged."""
    ctx = Pass(job, status.model_copy(deep=True), Observed(), now)
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



def recount_steps_lost(st: JobStatus, resume: int | None) -> None:
    """The steps the new attempt redoes, as of the checkpoint it resumes from: a checkpoint published after the
    failure was seen (an evicted gang's SIGTERM save, written in its grace period) leaves fewer than the failure's
    pass counted from the checkpoint before it. Called before the attempt moves on: `st.progress` is the old one's."""
    p = st.progress
    if resume is None or not st.steps_lost or p is None or (p.attempt is not None and p.attempt != st.attempt):
        return
    st.steps_lost[-1] = min(st.steps_lost[-1], max(0, p.step - resume))


