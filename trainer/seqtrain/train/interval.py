"""The checkpoint interval from measurements (`checkpoint.intervalSteps: auto`). Pure: no torch, no clock.

Young (1974) and Daly (2006): with `delta` the time one save blocks training and `M` the mean time between
failures of the whole gang, the training time between checkpoints that loses the least (saves + work redone after
a failure) is

    tau = sqrt(2 * delta * M) - delta    for delta < 2M,        tau = M otherwise

(Daly's first-order estimate). The interval in steps is tau / step time, within the user's bounds.

The MTBF combines the job's own history with the cluster's prior: before any failure, the prior (MTBF of one rank,
e.g. one GPU, divided by the ranks of the gang: any rank's failure stops the gang) plus the failure-free time seen
so far; once the job has failed, its own rate (training time / failures), whatever the prior said. A prior that
the job's failures contradict is the wrong one for this job, and what matters is the next failure of this gang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Meta's Llama 3 405B run: 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. about 50,000 GPU-hours
# between failures per GPU (Llama 3 paper, section 3.3.4). The operator's chart can set another prior.
DEFAULT_RANK_MTBF_HOURS = 50_000.0
WARMUP_STEPS = 3  # the first steps (allocations, caches) are not the step time
STEP_EMA = 0.2  # weight of the newest step in the step-time average


def young_daly_seconds(save_s: float, mtbf_s: float) -> float:
    """Daly's optimum training time between checkpoints (seconds), for save cost `save_s` and gang MTBF `mtbf_s`."""
    if save_s <= 0:
        return 0.0  # a free save: every step
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    return math.sqrt(2 * save_s * mtbf_s) - save_s


def gang_mtbf(failures: int, exposure_s: float, rank_mtbf_hours: float, ranks: int) -> tuple[float, str]:
    """(MTBF of the gang in seconds, "measured" | "prior"): see the module's docstring."""
    if failures > 0:
        return max(exposure_s, 1.0) / failures, "measured"
    return rank_mtbf_hours * 3600.0 / max(1, ranks) + exposure_s, "prior"


def interval_steps(save_s: float, mtbf_s: float, step_s: float, lo: int = 1,
                   hi: int | None = None) -> tuple[int, str]:
    """(steps between checkpoints, why): Young/Daly in steps, clamped to [lo, hi]."""
    tau = young_daly_seconds(save_s, mtbf_s)
    steps = max(1, round(tau / step_s)) if step_s > 0 else lo
    if steps < lo:
        return lo, "minIntervalSteps"
    if hi is not None and steps > hi:
        return hi, "maxIntervalSteps"
    return min(steps, 10**9), "youngDaly"


@dataclass
class IntervalPolicy:
    """Rank 0's view: when is the next checkpoint due, and why. Times are passed in (monotonic seconds).

    fixed_steps: the user's intervalSteps (None: auto or seconds); fixed_seconds: intervalSeconds."""

    fixed_steps: int | None = None
    fixed_seconds: float | None = None
    min_steps: int = 1
    max_steps: int | None = None
    ranks: int = 1
    failures: int = 0
    earlier_running_s: float = 0.0
    rank_mtbf_hours: float = DEFAULT_RANK_MTBF_HOURS
    save_s: float | None = None
    save_source: str | None = None
    step_s: float | None = None
    _steps_seen: int = 0
    _interval: int | None = None
    _why: str = "firstSave"
    _inputs: tuple[float | None, float | None, float] = (None, None, 0.0)  # save, step, attempt seconds used

    @property
    def auto(self) -> bool:
        return self.fixed_steps is None and self.fixed_seconds is None

    def observe_step(self, seconds: float) -> None:
        self._steps_seen += 1
        if self._steps_seen <= WARMUP_STEPS and self.step_s is not None:
            self.step_s = seconds  # still warming up: the newest is the best guess
        else:
            self.step_s = seconds if self.step_s is None else (1 - STEP_EMA) * self.step_s + STEP_EMA * seconds

    def observe_save(self, seconds: float, source: str = "measured") -> None:
        self.save_s, self.save_source = seconds, source

    def mtbf(self, attempt_s: float) -> tuple[float, str]:
        return gang_mtbf(self.failures, self.earlier_running_s + attempt_s, self.rank_mtbf_hours, self.ranks)

    def recompute(self, attempt_s: float) -> int | None:
        """The interval in steps from what is known now (None: not known yet: no save or step time measured)."""
        self._inputs = (self.save_s, self.step_s, attempt_s)
        if self.fixed_steps is not None:
            self._interval, self._why = self.fixed_steps, "user"
        elif self.fixed_seconds is not None:
            self._interval, self._why = None, "user"
            if self.step_s:
                self._interval = max(1, round(self.fixed_seconds / self.step_s))
        elif self.save_s is None or self.step_s is None:
            self._interval, self._why = None, "firstSave"
        else:
            mtbf, _ = self.mtbf(attempt_s)
            self._interval, self._why = interval_steps(self.save_s, mtbf, self.step_s, self.min_steps, self.max_steps)
        return self._interval

    def due(self, step: int, steps_since_save: int, seconds_since_save: float) -> bool:
        """Whether step `step` (just trained) should be saved; the end of training is the caller's rule."""
        if self.fixed_steps is not None:
            return step % self.fixed_steps == 0  # as before: multiples of the interval, whatever was resumed
        if self.fixed_seconds is not None:
            return seconds_since_save >= self.fixed_seconds
        if self._interval is None:  # auto, nothing measured yet: the first save measures the cost
            return steps_since_save >= max(self.min_steps, WARMUP_STEPS)
        return steps_since_save >= self._interval

    def report(self) -> dict:
        """The `status.checkpointPolicy` object (wire form): the figures of the last recompute(), so intervalSteps
        follows from saveSeconds, mtbfSeconds and stepSeconds as shown."""
        save_s, step_s, attempt_s = self._inputs
        mtbf, mtbf_source = self.mtbf(attempt_s)
        sources = {"intervalSteps": self._why, "mtbfSeconds": mtbf_source}
        if self.save_source:
            sources["saveSeconds"] = self.save_source
        out = {"intervalSteps": self._interval, "saveSeconds": _round(save_s), "mtbfSeconds": _round(mtbf),
               "stepSeconds": _round(step_s), "failures": self.failures,
               "exposureSeconds": round(self.earlier_running_s + attempt_s, 3), "sources": sources}
        if self.fixed_seconds is not None:
            out["intervalSeconds"] = self.fixed_seconds
        return {k: v for k, v in out.items() if v is not None}


def _round(x: float | None) -> float | None:
    # significant digits, not decimal places: a 0.01 s step rounded to 4 places is off by up to 0.5 %, and an
    # interval of hundreds of steps computed from the shown figures then misses the reported one by 2 or more
    return None if x is None else float(f"{x:.6g}")
