"""Every replica of the live gang runs: say so once, then watch it: a hang (no step within
faultTolerance.hangTimeoutSeconds) is a failure, and an elastic gang below its size grows back when capacity
returns."""

from __future__ import annotations

from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller import gang_policy
from seqtrain_operator.controller.clock import iso, parse, seconds_between
from seqtrain_operator.controller.context import POLL_SECONDS, Pass, avoid
from seqtrain_operator.controller.failed import on_failure
from seqtrain_operator.controller.failure_policy import Failure, hang_failure
from seqtrain_operator.controller.types import ReplicaObservation, RequeueAfter

# An elastic gang running below its size grows back only after running this long at the smaller one.
ELASTIC_GROW_AFTER_SECONDS = 30.0


def gang_running(ctx: Pass, current: tuple[ReplicaObservation, ...]) -> None:
    st = ctx.st
    if st.phase != "Running":
        st.create_failures = 0
        cond.set_condition(st, "Scheduled", "True", "GangRunning", f"{len(current)} replica(s) running", ctx.now)
        if (c := cond.get(st, "Starting")) is not None and c.status == "True":
            cond.set_condition(st, "Starting", "False", "Started", f"attempt {st.attempt}: every replica started",
                               ctx.now)
        cond.enter_phase(st, "Running", "GangRunning", f"attempt {st.attempt}: all replicas running", ctx.now)
        ctx.event("Normal", "Running", f"attempt {st.attempt}: all {len(current)} replica(s) running")
    hang = hung(ctx)
    if hang is not None:
        on_failure(ctx, hang)
    elif (grow := growth(ctx)) is not None:
        scale_up(ctx, grow)
    elif (limit := ctx.job.spec.fault_tolerance.hang_timeout_seconds) is not None:
        ctx.actions.append(RequeueAfter(float(limit)))


def hung(ctx: Pass) -> Failure | None:
    """The hang failure once no step completed within faultTolerance.hangTimeoutSeconds (None: not hung, or
    unknown because the progress cannot be read: then the Progressing condition says so)."""
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


def growth(ctx: Pass) -> gang_policy.Admitted | None:
    """A larger size the elastic gang fits at now, once it has run at its current size for a while (a node that
    flaps must not rescale the gang back and forth)."""
    st = ctx.st
    running = cond.get(st, "Running")
    since = parse(running.last_transition_time if running else None)
    if not ctx.job.spec.elastic or since is None or seconds_between(since, ctx.now) < ELASTIC_GROW_AFTER_SECONDS:
        return None
    return gang_policy.growth(ctx.job, st.replicas or ctx.job.spec.replicas, ctx.observed, avoid(ctx))


def scale_up(ctx: Pass, grow: gang_policy.Admitted) -> None:
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
