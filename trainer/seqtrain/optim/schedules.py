"""Learning-rate schedules after warmup, beyond constant and cosine (`seqtrain.optim.build.lr_factor`).

`step` is the 0-based index of the optimizer update about to be applied; warmup is handled by the caller.
- linear: straight line from 1 at the end of warmup down to minLrRatio at the last step
- wsd:    warmup-stable-decay: 1 until the last `decayFraction` of all steps, then linear down to minLrRatio
          (the decay ends exactly at the last step, so a WSD run can be branched off at any stable point)
- cyclic: triangular wave between 1 and minLrRatio with period `cycleSteps`, starting at the peak
"""

from __future__ import annotations

from seqtrain.spec.training import ScheduleSpec


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
