"""The observability callbacks a run gets from its spec and runtime config, in the order they must run.

Order matters because callbacks may add keys to the step's metrics: throughput (mfu) and evaluation (val_*)
come first so the consumers (profiler window aside: Prometheus, progress, TensorBoard) see the finished dict.
"""

from __future__ import annotations

import json
import os
import socket
from typing import TYPE_CHECKING, Any

from seqtrain.checkpoint.discovery import quarantined, read_complete, step_dir
from seqtrain.obs.progress import ProgressReporter, write_json_atomic
from seqtrain.runtime.callbacks import BaseCallback

if TYPE_CHECKING:
    from seqtrain.train.loop import Trainer


ENDPOINTS_DIR = "endpoints"


def record_endpoint(trainer: Trainer, kind: str, port: int | None) -> None:
    """Note where this rank serves `kind` ("metrics" / "progress") in `<workdir>/endpoints/rank-<R>.json`, so a
    port chosen by the OS (runtime port 0, as local runs use) can be found by scrapers and tests."""
    if port is None:
        return
    path = os.path.join(trainer.runtime.workdir, ENDPOINTS_DIR, f"rank-{trainer.ctx.rank}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("attempt") != trainer.runtime.attempt:
            data = {}
    except (OSError, ValueError):
        data = {}
    data |= {"rank": trainer.ctx.rank, "attempt": trainer.runtime.attempt, "host": socket.gethostname(),
             f"{kind}_port": port}
    write_json_atomic(path, data)


class PrometheusExporter(BaseCallback):
    """Every rank serves `/metrics` on `runtime.metricsPort + local rank` (port 0: any free port)."""

    def __init__(self, trainer: Trainer, port: int) -> None:
        from seqtrain.obs.prometheus import TrainerMetrics

        s = trainer.spec
        info = {"arch": s.model.arch, "world_size": str(trainer.ctx.world_size), "attempt": str(trainer.runtime.attempt)}
        self.metrics = TrainerMetrics(trainer.job.name, trainer.ctx.rank, info)
        self.port = port + trainer.ctx.local_rank if port else 0

    def on_train_start(self, trainer: Trainer) -> None:
        record_endpoint(trainer, "metrics", self.metrics.serve(self.port))

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.observe_step(step, metrics)

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.observe_eval(metrics)

    def on_train_end(self, trainer: Trainer, reason: str) -> None:
        self.metrics.close()


class ProgressPublisher(BaseCallback):
    """Rank 0: `status.progress`-shaped JSON on `runtime.progressPort` and in `<workdir>/progress.json`, plus
    `lastCheckpoint` ({step, path, time}) for an operator that cannot list the checkpoint folder itself."""

    def __init__(self, trainer: Trainer, port: int | None) -> None:
        self.reporter = ProgressReporter(trainer.runtime.workdir, trainer.total_steps, port)
        self._saving: int | None = None  # a step the loop checkpoints after the callbacks

    def on_train_start(self, trainer: Trainer) -> None:
        record_endpoint(trainer, "progress", self.reporter.port)
        last = trainer.last_metrics
        # stop fields from a previous attempt's early stop must not stick to this one
        # Checkpoints set aside as unusable (this start or an earlier one): the operator turns each into one
        # Warning Event, whichever backend runs the job.
        skipped = [{"step": step, "reason": why} for step, why in quarantined(trainer.runtime.checkpoint_dir)]
        self.reporter.update(flush=True, step=trainer.step, loss=last.get("loss"), stop_reason=None, stop_message=None,
                             **self._checkpoint(trainer, trainer.step) if trainer.resumed_from else {},
                             **{"skippedCheckpoints": skipped} if skipped else {})

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        saved = self._checkpoint(trainer, self._saving) if self._saving is not None else {}
        if trainer.checkpoint_due() or saved:
            self._saving = step if trainer.checkpoint_due() else None
        # else: an async save still being written stays pending, reported at the first step end after it is published
        self.reporter.update(flush=bool(saved), step=step, loss=metrics.get("loss"),
                             tokens_per_second=metrics.get("tokens_per_s"), mfu=metrics.get("mfu"), **saved)

    @staticmethod
    def _checkpoint(trainer: Trainer, step: int) -> dict[str, Any]:
        info = read_complete(step_dir(trainer.runtime.checkpoint_dir, step))
        if info is None:
            return {}
        return {"lastCheckpoint": {"step": info.step, "path": info.path, "time": info.time}}

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        fields = {"val_loss": metrics.get("val_loss"), "val_perplexity": metrics.get("val_perplexity"),
                  "val_bits_per_byte": metrics.get("val_bpb"), "best_val_loss": metrics.get("best_val_loss"),
                  "best_step": metrics.get("best_step")}
        if metrics.get("stop_reason"):
            fields |= {"stop_reason": metrics["stop_reason"], "stop_message": metrics.get("stop_message")}
        self.reporter.update(flush=True, step=step, **fields)

    def on_train_end(self, trainer: Trainer, reason: str) -> None:
        # the loop's last save (end, stop, SIGTERM) happened after the last on_step_end
        self.reporter.update(flush=True, **self._checkpoint(trainer, trainer.step))
        self.reporter.finish()
        self.reporter.close()
