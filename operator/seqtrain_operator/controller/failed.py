"""The failure policy executed (JobSet's executeFailurePolicy): what a failed gang leads to. The cause is chosen and
classified by failure_policy.py; here it is charged to its budget (restarts, infrastructure restarts, or none for a
disruption) and the gang restarts from the latest checkpoint after a backoff, or the job ends Failed (a permanent
failure, a spent budget, a start-up failure that repeats)."""

from __future__ import annotations

from datetime import timedelta

from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller.backoff import backoff_seconds
from seqtrain_operator.controller.clock import iso, parse, seconds_between
from seqtrain_operator.controller.context import POLL_SECONDS, Pass, fail, resume_step, resumes
from seqtrain_operator.controller.failure_policy import Failure, FailureClass, root_cause
from seqtrain_operator.controller.types import ReplicaObservation, RequeueAfter

# When a node dies its pods' peers often fail first (a reset connection) while the dead node still looks Ready (the
# node controller marks it NotReady only after its monitor grace period). Charging that echo to the user would use up
# the wrong budget and avoid the wrong node: a user-class failure is acted on only after this long, or at once when
# nothing of the gang runs any more; a replica on a NotReady node is waited for until it is lost or back.
FAILURE_SETTLE_SECONDS = 15.0


def gang_failed(ctx: Pass, current: tuple[ReplicaObservation, ...]) -> None:
    """A replica of the live gang failed: act on the root cause, once the gang has settled (see
    FAILURE_SETTLE_SECONDS)."""
    failure = root_cause(current, ctx.gang_job.spec.resources.procs)
    assert failure is not None
    if failure.cls is FailureClass.USER and (wait := settling(ctx, current)) is not None:
        ctx.actions.append(RequeueAfter(wait))
        return
    on_failure(ctx, failure)


def settling(ctx: Pass, current: tuple[ReplicaObservation, ...]) -> float | None:
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


def on_failure(ctx: Pass, failure: Failure) -> None:
    """Tear the gang down and charge `failure`: restart after a backoff, or Failed."""
    st, ft = ctx.st, ctx.job.spec.fault_tolerance
    ctx.delete(st.attempt, failure.reason)
    done = st.progress.step if st.progress else 0
    ck = resume_step(ctx) or 0
    if failure.cls is FailureClass.PERMANENT:
        fail(ctx, failure.reason, f"{failure.message}; not restarting (permanent failure)")
        return
    if failure.cls is FailureClass.INFRASTRUCTURE:
        if st.infra_restarts >= ft.max_infra_restarts:
            fail(ctx, failure.reason, f"{failure.message}; faultTolerance.maxInfraRestarts "
                 f"({ft.max_infra_restarts}) reached")
            return
        st.infra_restarts += 1
        if failure.node:
            st.failed_nodes[failure.node] = iso(ctx.now + timedelta(seconds=ft.node_avoid_seconds))
    elif failure.cls is FailureClass.DISRUPTION:
        pass  # the cluster's choice, on a healthy node: no budget spent, no node avoided
    else:
        if repeated_startup_failure(ctx, failure):
            said = "" if failure.error is None or failure.error in failure.message else f" ({failure.error})"
            fail(ctx, "StartupFailure", f"{failure.message}{said}; attempts {st.attempt - 1} and {st.attempt} "
                 "failed the same way before their first step (a deterministic start-up failure): not restarting; "
                 "fix the cause in the rank log and resubmit")
            return
        if st.restarts >= ft.max_restarts:
            fail(ctx, failure.reason, f"{failure.message}; faultTolerance.maxRestarts ({ft.max_restarts}) reached")
            return
        st.restarts += 1
    delay = backoff_seconds(ft, st.restarts + st.infra_restarts)
    st.steps_lost.append(max(0, done - ck))
    st.next_restart_time = iso(ctx.now + timedelta(seconds=delay))
    count = f"restart {st.restarts}/{ft.max_restarts}" if failure.cls is FailureClass.USER else \
        "restart (a disruption: not counted)" if failure.cls is FailureClass.DISRUPTION else \
        f"infrastructure restart {st.infra_restarts}/{ft.max_infra_restarts}"
    msg = f"{failure.message}; {count} in {delay:g}s {resumes(ck)}"
    cond.enter_phase(st, "Restarting", failure.reason, msg, ctx.now)
    ctx.actions.append(RequeueAfter(delay))
    ctx.event("Warning", failure.reason, msg)


def repeated_startup_failure(ctx: Pass, failure: Failure) -> bool:
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
