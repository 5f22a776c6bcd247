"""The live gang is created but not every replica runs yet: wait, with a deadline for each way of waiting. Queued
whole in an external scheduler (kept: its place in the queue is worth keeping); retrying an image pull
(faultTolerance.imagePullTimeoutSeconds, then Failed); refused by the scheduler (scheduling.pendingGraceSeconds, or
autoscaleTimeoutSeconds for a gang created for the autoscaler) or placed but not starting
(scheduling.startTimeoutSeconds): past those the gang is torn down and re-planned; a slow start is said once per
attempt in the Starting condition."""

from __future__ import annotations

from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller import gang_policy
from seqtrain_operator.controller.clock import iso, parse, seconds_between
from seqtrain_operator.controller.context import POLL_SECONDS, SCALE_UP, Pass, fail
from seqtrain_operator.controller.failure_policy import IMAGE_PULL_REASONS
from seqtrain_operator.controller.types import ReplicaObservation, RequeueAfter

# Placed replicas still starting this long (a large image pull, a volume attach) get the Starting condition. A
# quicker start is not worth a status write: a burst of thousands of pods keeps the kubelets busy for more than 10 s
# (`seqtrain bench operator`, docs/benchmarks.md), and every gang would then cost one more write.
SLOW_START_SECONDS = 30.0


def gang_pending(ctx: Pass, current: tuple[ReplicaObservation, ...]) -> None:
    st, job = ctx.st, ctx.job
    if st.phase != "Scheduling":
        cond.enter_phase(st, "Scheduling", "GangCreated", f"attempt {st.attempt}: waiting for replicas", ctx.now)
    native = job.spec.scheduling.gang == "native"
    if not native and gang_policy.queued(ctx.gang_job, current):
        queued(ctx, current)
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
    if _image_pull(ctx, current, waited):
        return
    # Replicas still in kube-scheduler's queue (native gangs: not yet tried, not refused) are not stuck; a burst of
    # thousands of pods takes it a while. Stuck: refused by the scheduler (not placed on a node).
    stuck = [r for r in current if r.phase == "Pending" and not r.node and not (native and r.queued)]
    # A replica not observed at all while the gang is pending: its creation is still to show in the mirror, or its
    # pod was deleted before the gang ran (an eviction, a `kubectl delete`). Nothing re-creates one pod of a live
    # gang, so past the same grace it counts as stuck: the gang is torn down and re-planned (found by the chaos
    # soak, seed 41: an evicted pod left its gang Scheduling, the other replica running, for good).
    absent = gang_policy.missing(ctx.gang_job, current)
    # Placed and starting (ContainerCreating: pulling a large image, attaching a volume) is progress, with a deadline
    # of its own: tearing it down would only start the pull or the attach again elsewhere.
    starting = [r for r in current if r.phase == "Pending" and r.node]
    start_limit = job.spec.scheduling.start_timeout_seconds
    if (waited > grace and (stuck or absent)) or (waited > start_limit and starting):
        # A partly started gang holds resources others need: tear it down and re-plan from scratch.
        why, limit = ("PendingTimeout", grace) if waited > grace and (stuck or absent) else ("StartTimeout",
                                                                                            start_limit)
        what = ("still unschedulable" + (" (the autoscaler added no room for them)" if scaling else "")
                if why == "PendingTimeout" and stuck else
                f"absent (replica {absent[0]}'s pod is gone)" if why == "PendingTimeout" else "placed but not started")
        ctx.delete(st.attempt, why)
        cond.set_condition(st, "Scheduled", "False", why, f"replicas {what} after {limit}s; re-planning", ctx.now)
        ctx.event("Warning", why, f"attempt {st.attempt}: replicas {what} for {waited:.0f}s")
        st.phase = "Scheduling"
        return
    placed = _slow_start(ctx, starting, waited, start_limit)
    deadlines = (([grace - waited] if stuck or absent else []) + ([start_limit - waited] if starting else [])
                 + ([SLOW_START_SECONDS - max(placed)] if starting and max(placed) < SLOW_START_SECONDS else []))
    ctx.actions.append(RequeueAfter(max(1.0, min(deadlines + [POLL_SECONDS * 6]))))


def _image_pull(ctx: Pass, current: tuple[ReplicaObservation, ...], waited: float) -> bool:
    """A failing pull is transient (registry hiccups on a large image): its own deadline replaces the pending
    grace, since tearing down and re-planning would only pull again from scratch. True when a replica is pulling
    (the pass is decided)."""
    st, job = ctx.st, ctx.job
    pulling = [r for r in current if r.phase == "Pending" and r.reason in IMAGE_PULL_REASONS]
    if not pulling:
        return False
    r, limit = pulling[0], job.spec.fault_tolerance.image_pull_timeout_seconds
    where = f"replica {r.replica}" + (f" on {r.node}" if r.node else "")
    if waited > limit:
        ctx.delete(st.attempt, r.reason or "ErrImagePull")
        fail(ctx, r.reason or "ErrImagePull", f"{where} could not pull image {job.spec.image} for "
             f"{waited:.0f}s (faultTolerance.imagePullTimeoutSeconds = {limit}): {r.message}")
        return True
    st.message = f"attempt {st.attempt}: {where} is retrying the image pull ({r.reason}): {r.message}"[:1000]
    ctx.actions.append(RequeueAfter(max(1.0, min(POLL_SECONDS * 6, limit - waited))))
    return True


def _slow_start(ctx: Pass, starting: list[ReplicaObservation], waited: float, start_limit: int) -> list[float]:
    """The Starting condition: True once a placed replica has been starting for SLOW_START_SECONDS (said once per
    attempt), False once every placed replica started. Returns how long each starting replica has been placed
    (unknown: since the gang was created)."""
    st = ctx.st
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
    return placed


def queued(ctx: Pass, current: tuple[ReplicaObservation, ...]) -> None:
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
