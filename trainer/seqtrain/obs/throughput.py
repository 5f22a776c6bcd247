"""Per-step throughput accounting: model TFLOP/s, MFU and HFU added to the step's metrics.

Adds to each metrics.jsonl line: `model_tflops` (achieved model TFLOP/s over all ranks, from every computed position),
and where a peak is known (a GPU in the table or `spec.resources.peakTflops`) `mfu` and `hfu` as fractions.
On a CPU without an override both stay absent: an invented peak would make the figure meaningless.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from seqtrain.obs.flops import recomputed_flops, token_flops
from seqtrain.obs.peaks import device_peak_flops, utilization
from seqtrain.runtime.callbacks import BaseCallback

if TYPE_CHECKING:
    from seqtrain.train.loop import Trainer


class Throughput(BaseCallback):
    def __init__(self, trainer: Trainer) -> None:
        s = trainer.spec
        flops = token_flops(s.model, s.data.seq_len)
        ac = s.optimization.activation_checkpointing
        self.model_flops = flops.training
        self.hardware_flops = flops.hardware(recomputed_flops(s.model, s.data.seq_len, ac.policy, ac.every))
        self.peak, self.peak_source = device_peak_flops(s.optimization.precision, s.resources.peak_tflops)
        self.devices = trainer.ctx.world_size

    def on_train_start(self, trainer: Trainer) -> None:
        peak = f"{self.peak / 1e12:g} TFLOP/s per device ({self.peak_source})" if self.peak else self.peak_source
        trainer.log(f"flops: {self.model_flops / 1e6:.2f} MFLOP per token (model), "
                    f"{self.hardware_flops / 1e6:.2f} (hardware); peak: {peak}")

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
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
