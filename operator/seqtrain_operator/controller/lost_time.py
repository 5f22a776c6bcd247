"""Where the time went (pure): the job's wall time split into productive training and lost time by reason.

Every decide() pass attributes the wall time since the previous pass (`status.timeLedger.at`) to the state the job
was in then (`timeLedger.state`), and moves the state on from what the pass decided and observed:

  queueing   created, or waiting to be admitted and placed (no gang yet, queued in Kueue, unschedulable)
  startup    gang created until its trainer began the first step (progress.trainingStartedAt)
  restart    from a failure (the last step before it, progress.updatedAt) until training resumed: detection,
             backoff, re-queueing and the new gang's start-up
  training   productive, less what the trainer reports it was blocked on saves (progress.checkpointSeconds ->
             checkpointStall) and, after a failure, the steps redone from the checkpoint (status.stepsLost ->
             recomputed, at progress.stepSeconds each)
  suspended  spec.suspend, or an interrupted local run
  done       Succeeded or Failed: the wall clock stops

Time found lost inside training (saves, redone steps, the time between the last step and a failure noticed
later) is moved out of productiveSeconds, never invented, so productiveSeconds + sum(lostSeconds) equals the wall
time from the job's creation, pass after pass; goodput = productiveSeconds / that sum (controller/goodput.py).

Level-based like decide(): the inputs are the persisted status and what is observed now; a pass whose status
write was skipped (reconcile.py writes lost time only along with a real change) is simply attributed again by
the next pass from the persisted ledger.
"""

from __future__ import annotations

from datetime import datetime

from seqtrain.spec.status import TERMINAL_PHASES, JobStatus, LostSeconds, Progress, TimeLedger
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller.clock import iso, parse, seconds_between

REASONS = ("queueing", "startup", "checkpoint_stall", "restart", "recomputed", "suspended")
# Scheduled-condition reasons of a job that waits for admission (or re-plans) rather than starting pods.
_WAITING = frozenset({"Queued", "Unschedulable", "PendingTimeout", "CreateFailed"})


def lost_total(lost: LostSeconds | None) -> float:
    return sum(getattr(lost, r) for r in REASONS) if lost is not None else 0.0


def wall_seconds(st: JobStatus) -> float:
    """The wall time accounted so far: productive plus every lost reason."""
    return (st.productive_seconds or 0.0) + lost_total(st.lost_seconds)


def _trained(st: JobStatus, p: Progress | None) -> datetime | None:
    """When the trainer of the status's current attempt began its first step (None: not yet, or not known).
    A trainer that does not report its attempt counts once a step of it is newer than the attempt's gang."""
    if p is None or st.attempt <= 0:
        return None
    if p.attempt is not None:
        return parse(p.training_started_at) if p.attempt == st.attempt else None
    started, last = parse(st.attempt_start_time), parse(p.updated_at)
    return last if started is not None and last is not None and last >= started.replace(microsecond=0) else None


def next_state(prev: str, st: JobStatus, p: Progress | None) -> str:
    """Where the time goes from now on, given the status a pass decided."""
    if st.phase in TERMINAL_PHASES:
        return "done"
    if st.phase == "Suspended":
        return "suspended"
    if st.phase == "Restarting":
        return "restart"
    if st.phase == "Running" and _trained(st, p) is not None:
        return "training"
    if prev in ("restart", "training"):
        return "restart"  # the lost gang's successor is still on its way
    c = cond.get(st, "Scheduled")
    if st.attempt <= 0 or st.phase == "Pending" or (c is not None and c.reason in _WAITING):
        return "queueing"
    return "startup"


def _step_seconds(before: JobStatus, p: Progress | None) -> float:
    """The failed trainer's mean step time: as last seen before this pass, else as reported now."""
    return (before.progress.step_seconds if before.progress is not None else None) or \
        (p.step_seconds if p is not None else None) or 0.0


class _Books:
    def __init__(self, lost: LostSeconds, productive: float) -> None:
        self.lost, self.productive = lost, productive

    def add(self, reason: str, seconds: float) -> None:
        seconds = max(0.0, seconds)
        if reason == "training":
            self.productive += seconds
        elif reason != "done":
            setattr(self.lost, reason, getattr(self.lost, reason) + seconds)

    def unmove(self, reason: str, seconds: float) -> None:
        """Give back to productive `seconds` charged to `reason` by `move` (at most what is there)."""
        take = min(max(0.0, seconds), getattr(self.lost, reason))
        setattr(self.lost, reason, getattr(self.lost, reason) - take)
        self.productive += take

    def move(self, reason: str, seconds: float) -> None:
        """Charge `seconds` of what was counted productive to `reason` (at most what is there)."""
        take = min(max(0.0, seconds), self.productive)
        self.productive -= take
        setattr(self.lost, reason, getattr(self.lost, reason) + take)


def account(before: JobStatus, after: JobStatus, created: datetime | None, now: datetime) -> None:
    """Update `after` (the status a pass decided; its progress is what was observed) in place: attribute the wall
    time since the last pass, then record the new state. `created`: when the job was created (the custom
    resource's creationTimestamp; None: the first pass is the creation, as for a local run)."""
    now = parse(iso(now)) or now  # the ledger keeps milliseconds: never count the rest twice
    p = after.progress
    if before.time_ledger is not None:
        led = before.time_ledger.model_copy()
    else:  # a new job, or one an operator without this accounting ran so far
        origin = created or parse(before.start_time) or now
        first = "queueing" if before.attempt <= 0 else next_state("startup", before, before.progress)
        led = TimeLedger(at=iso(min(origin, now)), state=first, attempt=before.attempt)
    books = _Books(before.lost_seconds.model_copy() if before.lost_seconds else LostSeconds(),
                   before.productive_seconds or 0.0)
    since = parse(led.at) or now
    prev, state = led.state, next_state(led.state, after, p)

    def clamp(t: datetime | None, lo: datetime) -> datetime | None:
        return None if t is None else min(max(t, lo), now)

    train_from = since if prev == "training" else None
    if prev in ("queueing", "startup", "restart"):
        train_from = clamp(_trained(after, p), since)
    if train_from is None:
        books.add(prev, seconds_between(since, now))
    else:
        books.add(prev, seconds_between(since, train_from))
        last = parse(p.updated_at) if p is not None else None
        if state == "restart" and last is not None:
            # training stopped at its last step; what followed (a partial step, the failure's detection) is lost
            if last >= train_from:
                books.add("training", seconds_between(train_from, min(last, now)))
                books.add("restart", seconds_between(min(last, now), now))
            else:
                books.add("restart", seconds_between(train_from, now))
                if prev == "training":
                    books.move("restart", seconds_between(last, train_from))
        else:
            books.add("training", seconds_between(train_from, now))
        if len(after.steps_lost) > len(before.steps_lost) and prev == "training":
            led.recompute_pending_steps += after.steps_lost[-1]

    if p is not None and p.attempt is not None and p.attempt >= led.attempt:
        # One trainer process: its attempt and when it began training. A new one in the same attempt (its ranks
        # restarted in place, the pods kept) starts its save counter from zero, and the time from the old one's
        # last step until it trained was a restart, not training.
        same = p.attempt == led.attempt and (led.trainer_started_at is None
                                             or p.training_started_at == led.trainer_started_at)
        began, old = parse(p.training_started_at), parse(led.trainer_started_at)
        if not same and p.attempt == led.attempt and prev == "training" and began and old and began > old:
            bp = before.progress
            last = parse(bp.updated_at if bp is not None else None) or old
            books.move("restart", seconds_between(max(last, old), began))
            if len(after.steps_lost) == len(before.steps_lost) and bp is not None:
                # the steps since the checkpoint it resumed from (the latest the old process had published)
                ck = before.last_checkpoint.step if before.last_checkpoint is not None else 0
                led.recompute_pending_steps += max(0, bp.step - ck)
        seen = led.checkpoint_seconds if same else 0.0
        if p.checkpoint_seconds is not None:
            books.move("checkpoint_stall", p.checkpoint_seconds - seen)
        led.attempt, led.checkpoint_seconds = p.attempt, max(seen, p.checkpoint_seconds or 0.0)
        led.trainer_started_at = p.training_started_at

    if len(after.steps_lost) == len(before.steps_lost) and after.steps_lost and \
            after.steps_lost[-1] < before.steps_lost[-1]:
        # fewer steps to redo than the failure's pass counted (absent.recount_steps_lost: a checkpoint saved in
        # the grace period): not yet priced, they are forgotten; priced, that time was training after all
        fewer = before.steps_lost[-1] - after.steps_lost[-1]
        pending = min(led.recompute_pending_steps, fewer)
        led.recompute_pending_steps -= pending
        books.unmove("recomputed", (fewer - pending) * _step_seconds(before, p))

    if led.recompute_pending_steps:
        # priced at the failed trainer's step time, else the new one's once it has one: a pass may see the failure
        # before either trainer reported a step time
        step_s = _step_seconds(before, p)
        if step_s > 0:
            books.move("recomputed", led.recompute_pending_steps * step_s)
            led.recompute_pending_steps = 0
    led.at, led.state = iso(max(now, since)), state
    after.time_ledger = led
    after.productive_seconds = round(books.productive, 3)
    after.lost_seconds = LostSeconds(**{r: round(getattr(books.lost, r), 3) for r in REASONS})
