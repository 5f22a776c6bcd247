"""Deterministic fault injection for tests and drills, driven by environment variables (all unset normally). On a
cluster they go in the trainer container's env (spec.podTemplate): the one SEQTRAIN_ prefix a job may set.

- SEQTRAIN_FAULT_TERM_AT_STEP=N: behave as if SIGTERM arrived during step N (every rank): save, exit 143.
- SEQTRAIN_FAULT_KILL_AT_STEP=N[:RANK]: the rank (default 0) SIGKILLs itself right after step N, before
  any checkpoint of that step: a crash at a known point.
- SEQTRAIN_FAULT_IN_SAVE=crash|sleep:SECONDS [SEQTRAIN_FAULT_SAVE_STEP=N]: inside a checkpoint save, after
  every rank wrote its files and before rank 0 publishes: rank 0 SIGKILLs itself, or sleeps (a window in which
  a test kills the gang from outside). In an async save's writer process, "crash" kills the rank (and the writer
  with it), as a crash of the rank during its background write would.
- SEQTRAIN_FAULT_HOLD_AT_STEP=N[:SECONDS]: after step N is recorded (metrics.jsonl), every rank waits until SIGTERM
  arrives (at most SECONDS, default 300): a test can act "during training" at a known step however fast the
  machine is, instead of racing the job to its end.
- SEQTRAIN_FAULT_SAVE_DELAY=SECONDS: every checkpoint save, in every attempt, takes this much longer (rank 0
  sleeps where SEQTRAIN_FAULT_IN_SAVE acts): storage slower than this machine's, for the checkpoint-interval benchmark.
- SEQTRAIN_FAULT_MTBF_SECONDS=MEAN[:SEED]: rank 0 SIGKILLs itself after an exponentially distributed training time
  of mean MEAN seconds (drawn anew per attempt from SEED and SEQTRAIN_ATTEMPT), checked after every step: failures
  at a known rate, in every attempt.
- SEQTRAIN_FAULT_SETUP_ERROR=TEXT: every rank raises RuntimeError(TEXT) while setting up, before its first step
  (a start-up failure that repeats identically on every attempt).
- SEQTRAIN_FAULT_NAN_FILE=PATH: when PATH exists at a micro-batch's loss, rank 0 removes it and that loss becomes
  NaN (so the step's gradients are non-finite and the update is skipped): a NaN loss at a time chosen from outside
  (the chaos soak creates the file), not at a step fixed before the start.
- SEQTRAIN_FAULT_ATTEMPT=A: inject only in gang incarnation A (the controller sets SEQTRAIN_ATTEMPT for every
  rank), so a fault fires once and the restarted gang runs clean; an in-place restart (the launcher sets
  SEQTRAIN_RESTART_ROUND) is a new incarnation too: A fires in A's first start only, A.R in its in-place round R.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else None


def _armed() -> bool:
    raw = os.environ.get("SEQTRAIN_FAULT_ATTEMPT", "").strip()
    if not raw:
        return True
    attempt, _, rnd = raw.partition(".")
    return int(attempt) == _int("SEQTRAIN_ATTEMPT") and int(rnd or 0) == (_int("SEQTRAIN_RESTART_ROUND") or 0)


def term_requested_at(step: int) -> bool:
    return _armed() and _int("SEQTRAIN_FAULT_TERM_AT_STEP") == step


def maybe_kill_after_step(step: int, rank: int) -> None:
    raw = os.environ.get("SEQTRAIN_FAULT_KILL_AT_STEP", "").strip()
    if not raw or not _armed():
        return
    at, _, who = raw.partition(":")
    if int(at) == step and int(who or 0) == rank:
        print(f"seqtrain: fault injection: rank {rank} kills itself after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def in_save(step: int, rank: int, pid: int | None = None) -> None:
    """`pid`: the rank's training process, when called in its checkpoint writer process."""
    delay = os.environ.get("SEQTRAIN_FAULT_SAVE_DELAY", "").strip()
    if delay and rank == 0:
        time.sleep(float(delay))
    what = os.environ.get("SEQTRAIN_FAULT_IN_SAVE", "").strip()
    only = _int("SEQTRAIN_FAULT_SAVE_STEP")
    if not what or rank != 0 or (only is not None and only != step) or not _armed():
        return
    print(f"seqtrain: fault injection in checkpoint save of step {step}: {what}", flush=True)
    if what == "crash":
        if pid is not None and pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    elif what.startswith("sleep:"):
        time.sleep(float(what.split(":", 1)[1]))


_fail_at: float | None = None  # SEQTRAIN_FAULT_MTBF_SECONDS: when this process fails (monotonic)


def maybe_fail_at_rate(rank: int) -> None:
    global _fail_at
    raw = os.environ.get("SEQTRAIN_FAULT_MTBF_SECONDS", "").strip()
    if not raw or rank != 0:
        return
    if _fail_at is None:  # from the first step on: start-up is not training time
        mean, _, seed = raw.partition(":")
        draw = random.Random(f"{seed or 0}:{os.environ.get('SEQTRAIN_ATTEMPT', '1')}").expovariate(1.0 / float(mean))
        _fail_at = time.monotonic() + draw
    if time.monotonic() >= _fail_at:
        print(f"seqtrain: fault injection: rank {rank} fails (SEQTRAIN_FAULT_MTBF_SECONDS={raw})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def hold_after_step(step: int, terminated: Callable[[], bool]) -> bool:
    """True when it held (every rank holds at the same step, so the caller may agree on the signal again)."""
    raw = os.environ.get("SEQTRAIN_FAULT_HOLD_AT_STEP", "").strip()
    if not raw or not _armed():
        return False
    at, _, limit = raw.partition(":")
    if int(at) != step:
        return False
    print(f"seqtrain: fault injection: holding after step {step} until SIGTERM", flush=True)
    deadline = time.monotonic() + float(limit or 300)
    while not terminated() and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def maybe_fail_setup() -> None:
    text = os.environ.get("SEQTRAIN_FAULT_SETUP_ERROR", "").strip()
    if text and _armed():
        raise RuntimeError(text)


def poison_loss(loss: T) -> T:
    """`loss`, or NaN times it once SEQTRAIN_FAULT_NAN_FILE appears (rank 0 only: the gradients' all-reduce carries
    the NaN to every rank, so all of them skip the same step). One stat per micro-batch, only with the variable set."""
    path = os.environ.get("SEQTRAIN_FAULT_NAN_FILE", "")
    if not path or os.environ.get("RANK", "0") != "0":
        return loss
    try:
        os.unlink(path)
    except OSError:
        return loss
    print("seqtrain: fault injection: this step's loss is NaN", flush=True)
    return loss * float("nan")
