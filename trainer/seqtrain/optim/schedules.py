"""Learning-rate schedules (torch-free: the local runner checks a resume with them before starting any rank).

`lr_factor` is the multiplier of the peak learning rate; after warmup, constant and cosine are computed there and
the others by `after_warmup_factor`:

`step` is the 0-based index of the optimizer update about to be applied; warmup is handled by the caller.
- linear: straight line from 1 at the end of warmup down to minLrRatio at the last step
- wsd:    warmup-stable-decay: 1 until the last `decayFraction` of all steps, then linear down to minLrRatio
          (the decay ends exactly at the last step, so a WSD run can be branched off at any stable point)
- cyclic: triangular wave between 1 and minLrRatio with period `cycleSteps`, starting at the peak
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from seqtrain.spec.training import ScheduleSpec, TrainingSpec


def lr_factor(step: int, spec: ScheduleSpec, total_steps: int) -> float:
    """Multiplier of the peak learning rate for the optimizer step with 0-based index `step`.

    Warmup rises linearly to 1 over `warmupSteps` (the first step already moves: (step+1)/warmup);
    cosine then falls to `minLrRatio` at the last step; constant stays at 1.
    """
    warm = spec.warmup_steps
    if step < warm:
        return (step + 1) / warm
    if spec.name == "constant":
        return 1.0
    if spec.name == "cosine":
        span = max(1, total_steps - 1 - warm)
        progress = min(1.0, (step - warm) / span)
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return after_warmup_factor(step, spec, total_steps)  # linear, wsd, cyclic


def after_warmup_factor(step: int, spec: ScheduleSpec, total_steps: int) -> float:
    warm, lo = spec.warmup_steps, spec.min_lr_ratio
    if spec.name == "linear":
        span = max(1, total_steps - 1 - warm)
        return 1.0 - (1.0 - lo) * min(1.0, (step - warm) / span)
    if spec.name == "wsd":
        decay_steps = max(1, round(spec.decay_fraction * total_steps))
        decay_start = max(warm, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        # the decay steps are decay_start .. total-1; the last one reaches the floor
        return 1.0 - (1.0 - lo) * min(1.0, (step - decay_start + 1) / (total_steps - decay_start))
    if spec.name == "cyclic":
        phase = ((step - warm) % spec.cycle_steps) / spec.cycle_steps  # 0 .. 1 within the cycle
        return lo + (1.0 - lo) * abs(1.0 - 2.0 * phase)
    raise ValueError(f"spec.training.schedule.name: unknown schedule {spec.name!r}; "
                     "use constant, cosine, linear, wsd or cyclic")


def steps_change(factor: Callable[[int, int], float], spec: ScheduleSpec, peak_lr: float, step: int,
                 planned: int, total: int, allowed: bool) -> tuple[str, bool]:
    """What resuming at `step` a run whose checkpoint was made for `planned` steps does when training.steps is now
    `total`: (the message the run prints at its start, whether it must refuse).

    The schedule is a function of training.steps, so it is recomputed for the new total. When that moves the
    learning rate of the next step (`factor(step, steps)` is the multiplier of optimizer step index `step`; a
    finished cosine run sits at its floor, a recomputed one jumps back near the peak) the run refuses unless
    training.allowScheduleChange is true: a silent jump can undo a finished run. A change that leaves that rate
    where it was (constant, cyclic, still in warmup) only says so.
    """
    before, after = peak_lr * factor(step, planned), peak_lr * factor(step, total)
    what = (f"training.steps is {total}, the checkpoint at step {step} was made for {planned}: the {spec.name} "
            f"schedule is recomputed for {total} steps")
    if abs(after - before) <= 0.01 * max(abs(before), 1e-30):
        return f"{what}; the learning rate of step {step + 1} stays {after:.2e}", False
    times = f" ({after / before:.2f}x)" if before > 0 else ""
    change = f"the learning rate of step {step + 1} becomes {after:.2e} instead of {before:.2e}{times}"
    if allowed:
        return f"{what} (training.allowScheduleChange); {change}", False
    return (f"{what}, so {change}; set training.allowScheduleChange: true to continue with the recomputed schedule, "
            f"or keep training.steps {planned}"), True


def resume_steps_change(training: TrainingSpec, step: int, planned: Any) -> tuple[str, bool] | None:
    """The check a resume makes at checkpoint `step` whose meta.json says it was made for `planned` steps (its
    `total_steps`): None when there is nothing to say (same steps, no record, or the run is already past the new
    total), else `steps_change`'s (message, refuse) for training.steps. The trainer runs it after loading the
    checkpoint; the local runner runs it on the same checkpoint's meta.json before starting any rank, so a refused
    change never starts a gang (nor marks a finished run Failed)."""
    total = training.steps
    if not isinstance(planned, int) or isinstance(planned, bool) or planned == total or step >= total:
        return None
    sched = training.schedule
    return steps_change(lambda s, t: lr_factor(s, sched, t), sched, training.optimizer.lr, step, planned, total,
                        training.allow_schedule_change)
