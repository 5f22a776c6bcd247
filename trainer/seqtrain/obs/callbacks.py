"""The observability callbacks a run gets from its spec and runtime config, in the order they must run.

Order matters because callbacks may add keys to the step's metrics: throughput (mfu) and evaluation (val_*)
come first so the consumers (profiler window aside: Prometheus, progress, TensorBoard) see the finished dict.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from seqtrain.checkpoint.discovery import quarantined, read_complete, step_dir
from seqtrain.obs.progress import ProgressReporter, write_json_atomic
from seqtrain.runtime.callbacks import BaseCallback

if TYPE_CHECKING:
    from seqtrain.train.loop import Trainer


ENDPOINTS_DIR = "endpoints"
WATCH_INTERVAL_S = 1.0  # how soon a save published between step ends reaches status.lastCheckpoint


def _iso_ms() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


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
        self.metrics.observe_checkpoint_stall(trainer.checkpoint_seconds)  # saves run after the step's callbacks

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.observe_eval(metrics)

    def on_train_end(self, trainer: Trainer, reason: str) -> None:
        self.metrics.close()


class ProgressPublisher(BaseCallback):
    """Rank 0: `status.progress`-shaped JSON on `runtime.progressPort` and in `<workdir>/progress.json`, plus
    `lastCheckpoint` ({step, path, time}) for an operator that cannot list the checkpoint folder itself."""

    def __init__(self, trainer: Trainer, port: int | None) -> None:
        self.reporter = ProgressReporter(trainer.runtime.workdir, trainer.total_steps, port)
        self._saving: int | None = None  # a step the loop checkpoints after the callbacks, until it is reported
        self._saving_lock = threading.Lock()  # `_saving` is taken by one reporter: a step end or the watcher
        self._watcher: threading.Thread | None = None
        self._ended = threading.Event()
        self._step_times: list[float] = []  # this attempt's step times, for progress.stepSeconds

    @staticmethod
    def _auto_batch(trainer: Trainer) -> dict[str, Any]:
        """microBatchSize auto's choice and why, for status.progress on either backend (a pod's operator reads no
        rank log)."""
        reason = getattr(trainer, "auto_batch_reason", None)
        if reason is None:
            return {}
        return {"micro_batch_size": trainer.spec.training.micro_batch_size, "micro_batch_reason": reason}

    def on_train_start(self, trainer: Trainer) -> None:
        record_endpoint(trainer, "progress", self.reporter.port)
        last = trainer.last_metrics
        # stop fields from a previous attempt's early stop must not stick to this one
        # Checkpoints set aside as unusable (this start or an earlier one): the operator turns each into one
        # Warning Event, whichever backend runs the job.
        skipped = [{"step": step, "reason": why} for step, why in quarantined(trainer.runtime.checkpoint_dir)]
        # attempt and the moment training began: status.lostSeconds ends start-up (or a restart) there; the
        # in-place restart round (seqtrain.runtime.restart): the operator charges each in-place restart once it
        # sees the round here.
        rnd = os.environ.get("SEQTRAIN_RESTART_ROUND", "")
        self.reporter.update(flush=True, step=trainer.step, loss=last.get("loss"), stop_reason=None, stop_message=None,
                             attempt=trainer.runtime.attempt, restart_round=int(rnd) if rnd.isdigit() else 0,
                             training_started_at=_iso_ms(), checkpoint_seconds=0.0, step_seconds=None,
                             step_reached_before=trainer.metrics_writer.last_step,
                             resumed_from=trainer.resumed_from.step if trainer.resumed_from else None,
                             **self._checkpoint(trainer.runtime.checkpoint_dir, trainer.step) if trainer.resumed_from else {},
                             **{"skippedCheckpoints": skipped} if skipped else {}, **trainer.checkpoint_report(),
                             **self._auto_batch(trainer))

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        with self._saving_lock:
            saved = self._checkpoint(trainer.runtime.checkpoint_dir, self._saving) if self._saving is not None else {}
            if trainer.checkpoint_due() or saved:
                self._saving = step if trainer.checkpoint_due() else None
            # else: an async save still being written stays pending, reported when it is published
            if self._saving is not None:
                self._watch(trainer.runtime.checkpoint_dir)
        if isinstance(metrics.get("step_time_s"), (int, float)):
            self._step_times.append(float(metrics["step_time_s"]))
        # checkpointPolicy, workAtRisk (as of this step: its own save, if due, comes after the callbacks)
        self.reporter.update(flush=bool(saved), step=step, loss=metrics.get("loss"),
                             tokens_per_second=metrics.get("run_tokens_per_s"), eta_seconds=metrics.get("eta_s"),
                             last_tokens_per_second=metrics.get("tokens_per_s"), mfu=metrics.get("mfu"),
                             checkpoint_seconds=round(trainer.checkpoint_seconds, 3),
                             step_seconds=self._mean_step_seconds(), **saved, **trainer.checkpoint_report())

    def _mean_step_seconds(self) -> float | None:
        """The mean step time of this attempt, leaving out the first step (warm-up) once there are others."""
        times = self._step_times[1:] or self._step_times
        return round(sum(times) / len(times), 4) if times else None

    @staticmethod
    def _checkpoint(directory: str, step: int) -> dict[str, Any]:
        info = read_complete(step_dir(directory, step))
        if info is None:
            return {}
        return {"lastCheckpoint": {"step": info.step, "path": info.path, "time": info.time}}

    def _watch(self, directory: str) -> None:
        """Report the pending save once it is published, even if no step ends meanwhile (a gang held or hung right
        after it, a long evaluation, the last steps of a slow run): status.lastCheckpoint would otherwise lag behind
        status.workAtRisk.checkpointStep for as long. One thread at a time, polling the folder once a second (a
        missing folder costs a stat); it ends when the save is reported, by it or by a step end."""
        if self._watcher is not None and self._watcher.is_alive():
            return
        self._watcher = threading.Thread(target=self._report_when_published, args=(directory,), daemon=True,
                                         name="seqtrain-checkpoint-watch")
        self._watcher.start()

    def _report_when_published(self, directory: str) -> None:
        while not self._ended.wait(WATCH_INTERVAL_S):
            with self._saving_lock:
                if self._saving is None:
                    return
                saved = self._checkpoint(directory, self._saving)
                if saved:
                    self._saving = None
                    self.reporter.update(flush=True, **saved)
                    return

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        fields = {"val_loss": metrics.get("val_loss"), "val_perplexity": metrics.get("val_perplexity"),
                  "val_bits_per_byte": metrics.get("val_bpb"), "best_val_loss": metrics.get("best_val_loss"),
                  "best_step": metrics.get("best_step")}
        if metrics.get("stop_reason"):
            fields |= {"stop_reason": metrics["stop_reason"], "stop_message": metrics.get("stop_message")}
        self.reporter.update(flush=True, step=step, **fields)

    def on_train_end(self, trainer: Trainer, reason: str) -> None:
        self._ended.set()
        if self._watcher is not None:
            self._watcher.join()  # at most one poll: its report must not land after the final one below
        # the loop's last save (end, stop, SIGTERM) happened after the last on_step_end
        self.reporter.update(flush=True, checkpoint_seconds=round(trainer.checkpoint_seconds, 3),
                             **self._checkpoint(trainer.runtime.checkpoint_dir, trainer.step),
                             **trainer.checkpoint_report())
        self.reporter.finish()
        self.reporter.close()
