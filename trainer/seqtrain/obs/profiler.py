"""`spec.training.profile`: a torch.profiler trace of steps [startStep, startStep + steps) on every rank.

Writes `<workdir>/profile/attempt<A>-rank<R>.trace.json` (Chrome trace format: open in Perfetto or
chrome://tracing) and, on CUDA, `...memory.json` (the profiler's memory timeline: allocations by category over
time). Switch it on for one run with `seqtrain run job.yaml --set training.profile.startStep=5`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile

from seqtrain.runtime.callbacks import BaseCallback

if TYPE_CHECKING:
    from seqtrain.train.loop import Trainer

PROFILE_DIR = "profile"


class Profiler(BaseCallback):
    def __init__(self, trainer: Trainer) -> None:
        spec = trainer.spec.training.profile
        assert spec is not None
        self.first = spec.start_step
        self.last = spec.start_step + spec.steps - 1
        self.cuda = trainer.ctx.device.type == "cuda"
        stem = f"attempt{trainer.runtime.attempt}-rank{trainer.ctx.rank}"
        self.dir = os.path.join(trainer.runtime.workdir, PROFILE_DIR)
        self.trace_path = os.path.join(self.dir, f"{stem}.trace.json")
        self.memory_path = os.path.join(self.dir, f"{stem}.memory.json")
        self.prof: Any = None

    def _start(self, trainer: Trainer) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # record_shapes + profile_memory + with_stack are what the memory timeline needs.
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=self.cuda)
        self.prof.__enter__()
        trainer.log(f"profiler: capturing steps {self.first}..{self.last} into {self.dir}")

    def _stop(self, trainer: Trainer) -> None:
        prof, self.prof = self.prof, None
        if self.cuda:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        prof.export_chrome_trace(self.trace_path)
        if self.cuda:
            try:
                prof.export_memory_timeline(self.memory_path, device=str(trainer.ctx.device))
            except Exception as exc:  # noqa: BLE001 - the trace matters more than the optional timeline
                print(f"seqtrain: warning: no memory timeline: {exc}", file=sys.stderr)
        trainer.log(f"profiler: trace written to {self.trace_path}")

    def on_train_start(self, trainer: Trainer) -> None:
        # The window opens before step `first` runs, i.e. after step first-1 ended (or now, for step 1).
        if trainer.step + 1 == self.first:
            self._start(trainer)

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if self.prof is not None and step >= self.last:
            self._stop(trainer)
        elif self.prof is None and step + 1 == self.first:
            self._start(trainer)

    def on_train_end(self, trainer: Trainer, reason: str) -> None:
        if self.prof is not None:  # the run ended inside the window: keep what was captured
            self._stop(trainer)
