"""Per-step throughput accounting: model TFLOP/s, MFU and HFU, the run's average tokens/s and the ETA added to the
step's metrics.

Adds to each metrics.jsonl line: `model_tflops` (achieved model TFLOP/s over all ranks, from every computed position),
and where a peak is known (a GPU in the table or `spec.resources.peakTflops`) `mfu` and `hfu` as fractions.
On a CPU without an override both stay absent: an invented peak would make the figure meaningless.
`run_tokens_per_s`: tokens trained per second of training over the run (every kept step, earlier attempts' included:
metrics.jsonl's kept lines, `MetricsWriter.kept_tokens`), beside `tokens_per_s`, the step's own rate.
`eta_s`: the steps left times the wall time per step of this attempt's recent steps (`RunClock`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from seqtrain.obs.flops import recomputed_flops, token_flops
from seqtrain.obs.peaks import device_peak_flops, utilization
from seqtrain.runtime.callbacks import BaseCallback

if TYPE_CHECKING:
    from seqtrain.train.loop import Trainer


# Step ends the ETA's rate is taken over: enough to smooth a checkpoint save or an evaluation into the rate, few
# enough to follow a change of speed (a resize, a slower node) within a minute or two of steps.
ETA_WINDOW = 50


class RunClock:
    """The run's average tokens/s and the ETA, torch-free.

    Average: tokens / training seconds (step_time_s) of every kept step, those of earlier attempts given at start.
    ETA: wall time between this attempt's step ends (a checkpoint save or an evaluation between two steps counts,
    as it will again; start-up and restarts do not, being before the first step end of an attempt), over the last
    ETA_WINDOW steps, times the steps left. None until this attempt has completed two steps."""

    def __init__(self, total_steps: int, tokens: float = 0.0, seconds: float = 0.0) -> None:
        self.total_steps = total_steps
        self.tokens, self.seconds = tokens, seconds
        self._ends: deque[float] = deque(maxlen=ETA_WINDOW + 1)

    def step(self, step: int, tokens: Any, seconds: Any, now: float | None = None) -> dict[str, float]:
        """Record one step (its tokens and step_time_s); returns `run_tokens_per_s` and `eta_s` where known."""
        self._ends.append(time.monotonic() if now is None else now)
        if _finite(tokens) and _finite(seconds) and seconds > 0:
            self.tokens += tokens
            self.seconds += seconds
        out: dict[str, float] = {}
        if self.seconds > 0:
            out["run_tokens_per_s"] = round(self.tokens / self.seconds, 1)
        if len(self._ends) >= 2:
            per_step = (self._ends[-1] - self._ends[0]) / (len(self._ends) - 1)
            out["eta_s"] = round(max(0, self.total_steps - step) * per_step, 1)
        return out


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


class Throughput(BaseCallback):
    def __init__(self, trainer: Trainer) -> None:
        s = trainer.spec
        flops = token_flops(s.model, s.data.seq_len)
        ac = s.optimization.activation_checkpointing
        self.model_flops = flops.training
        self.hardware_flops = flops.hardware(recomputed_flops(s.model, s.data.seq_len, ac.policy, ac.every))
        self.peak, self.peak_source = device_peak_flops(s.optimization.precision, s.resources.peak_tflops)
        self.devices = trainer.ctx.world_size
        self.clock = RunClock(trainer.total_steps)

    def on_train_start(self, trainer: Trainer) -> None:
        # the steps metrics.jsonl kept from earlier attempts (rank 0 truncated it to the resumed step)
        w = getattr(trainer, "metrics_writer", None)
        self.clock = RunClock(trainer.total_steps, getattr(w, "kept_tokens", 0.0), getattr(w, "kept_seconds", 0.0))
        peak = f"{self.peak / 1e12:g} TFLOP/s per device ({self.peak_source})" if self.peak else self.peak_source
        trainer.log(f"flops: {self.model_flops / 1e6:.2f} MFLOP per token (model), "
                    f"{self.hardware_flops / 1e6:.2f} (hardware); peak: {peak}")

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        metrics.update(self.clock.step(step, metrics.get("tokens"), metrics.get("step_time_s")))
        seconds = metrics.get("step_time_s")
        if not isinstance(seconds, (int, float)) or seconds <= 0:
            return
        u = utilization(
            tokens=float(metrics.get("tokens") or 0),
            slots=float(metrics.get("slots") or 0),
            seconds=float(seconds),
            model_flops_per_token=self.model_flops,
            hardware_flops_per_token=self.hardware_flops,
            peak_flops_per_device=self.peak,
            devices=self.devices,
        )
        metrics["model_tflops"] = round(u.model_flops_per_s / 1e12, 6)
        if u.mfu is not None:
            metrics["mfu"] = round(u.mfu, 5)
        if u.hfu is not None:
            metrics["hfu"] = round(u.hfu, 5)
