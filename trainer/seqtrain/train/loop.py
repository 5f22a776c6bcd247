"""The training loop: a Trainer with small methods, an Engine that owns the optimizer step, and callbacks.

Per step: data -> engine.step -> agree across ranks (memory peak, stop requests) -> metrics -> callbacks ->
metrics.jsonl -> checkpoint when due. Trainer state (step, data position, RNG per rank) is saved beside the
engine's files in every checkpoint, so a resumed run continues bit-exactly (CPU, fp32).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np
import torch

from seqtrain.checkpoint import CheckpointInfo, CheckpointManager
from seqtrain.checkpoint.dcp_format import FORMAT
from seqtrain.checkpoint.manager import io_timeout_seconds
from seqtrain.checkpoint.safe_load import CheckpointUnavailable, UnusableCheckpoint, load_plain
from seqtrain.data import SequenceBatches, build_train_data
from seqtrain.data.prefetch import Prefetcher
from seqtrain.engine import Engine, StepStats, build_engine, engine_name
from seqtrain.models import build_model, count_parameters
from seqtrain.models.compile import prepare_model
from seqtrain.models.dispatch import setup_fused_projections, setup_kernels
from seqtrain.models.materialize import materialize, new_model, shards_first
from seqtrain.optim.schedules import resume_steps_change
from seqtrain.parallel.apply import init_mesh, parallelize
from seqtrain.parallel.pipeline import local_modules
from seqtrain.parallel.watchdog import waiting
from seqtrain.runtime import faults, restart
from seqtrain.runtime.callbacks import CallbackList
from seqtrain.runtime.dist import DistContext
from seqtrain.runtime.exitcodes import InvalidConfig, announce_phase
from seqtrain.runtime.launch import GRACE_ENV
from seqtrain.runtime.precision import enable_tf32, resolve_auto
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.runtime import RuntimeConfig
from seqtrain.train.interval import DEFAULT_RANK_MTBF_HOURS, IntervalPolicy
from seqtrain.train.metrics import MetricsWriter, peak_memory_mb

TRAINER_STATE = "trainer.pt"
SAVE_MARGIN = 1.25  # a SIGTERM save starts only when the grace left exceeds the last save's time by this factor


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def _epoch(iso: str | None) -> float | None:
    """A checkpoint's meta time (UTC, "%Y-%m-%dT%H:%M:%SZ") as seconds since the epoch; None when unreadable."""
    from datetime import datetime, timezone

    try:
        return datetime.strptime(iso or "", "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Tensors and plain values only, so the file loads with weights_only=True (no numpy objects pickled)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    """One rank's training run. `run()` returns "completed", "terminated" (SIGTERM) or "stopped" (a callback
    set `trainer.stop_training`)."""

    def __init__(
        self, job: SeqTrainJob, runtime: RuntimeConfig, ctx: DistContext, callbacks: list[Any] | None = None
    ) -> None:
        self.job = job = resolve_auto(job, ctx.device)  # precision/compile `auto` -> what this device runs
        # microBatchSize auto: why the entry point chose the size this job runs (None when the spec set it)
        self.auto_batch_reason: str | None = None
        self.spec = job.spec
        self.runtime = runtime
        self.ctx = ctx
        self.callbacks = CallbackList(callbacks)
        self.total_steps = self.spec.training.steps
        self.step = 0  # optimizer steps completed
        self.tokens_seen = 0  # real target tokens over all ranks and steps
        self.resumed_from: CheckpointInfo | None = None
        # The SIGTERM handler sets terminate_signal (sticky); terminate_requested is what all ranks agreed on at the
        # end of a step. Two fields, because a handler that ran right after the agreeing all-reduce returned would
        # otherwise be overwritten by its (older) result and the signal lost on every rank.
        self.terminate_signal = False
        self.terminate_time: float | None = None  # monotonic time the SIGTERM arrived (set with terminate_signal)
        self.terminate_requested = False
        self.stop_training = False  # set by callbacks (early stopping)
        self.stop_reason = ""
        self.last_metrics: dict[str, Any] = {}
        self.checkpoint_seconds = 0.0  # time this process's loop was blocked on saves (status.lostSeconds)
        # checkpoint.intervalSteps / intervalSeconds / auto: rank 0 decides when a save is due (seqtrain.train.interval)
        # and the end-of-step all-reduce tells every rank
        ck, history = self.spec.checkpoint, runtime.failure_history
        in_place_failures, in_place_s = restart.in_place_history(os.environ, time.time())  # rounds of this attempt
        self.interval = IntervalPolicy(
            fixed_steps=ck.fixed_steps, fixed_seconds=ck.interval_seconds, min_steps=ck.min_interval_steps,
            max_steps=ck.max_interval_steps, ranks=ctx.world_size, failures=history.failures + in_place_failures,
            earlier_running_s=history.running_seconds + in_place_s,
            rank_mtbf_hours=history.rank_mtbf_hours or DEFAULT_RANK_MTBF_HOURS)
        self.save_due = False  # agreed by every rank at the end of the step
        self.started_at = time.monotonic()
        self.saved_at = self.started_at  # the latest complete checkpoint (monotonic; this attempt's start else)
        self.saved_step = 0
        self.saved_wall: float | None = None  # time.time() of the latest complete checkpoint
        self.ckpt_block_s: float | None = None  # what the last save blocked this rank's training for
        self._logged_interval: int | None = None
        self._saved: CheckpointInfo | None = None  # the last save of this attempt
        self.model: torch.nn.Module
        self.engine: Engine
        self.data: SequenceBatches

    # ---- setup -------------------------------------------------------------------------------------------
    def setup(self) -> None:
        tr = self.spec.training
        if tr.deterministic:
            torch.use_deterministic_algorithms(True)
        tf32 = enable_tf32(self.ctx.device, tr.deterministic)
        if self.ctx.device.type == "cuda":
            self.log(tf32)
        seed_all(tr.seed)  # the same on every rank: identical initial weights without a broadcast
        init_mesh(self.ctx, self.job)  # dp/pp/tp groups; data shards by the dp rank from here on
        # torchtitan's order: build on the meta device, parallelise, then allocate and initialise only what this
        # rank holds (its tensor-parallel slices, its pipeline stages, its FSDP2 / ZeRO-3 shards); the weights
        # equal the single process's. docs/architecture.md ("Model materialisation") gives the order per engine.
        order = shards_first(self.job, self.ctx.dp_size)  # FSDP2 / ZeRO-3 shard before anything is allocated
        self.phase("building the model")
        if self.spec.model.init or self.spec.model.lora is not None:
            # fine-tuning: the whole model is built for real and loaded, adapters added, before it is split
            self.model = build_model(self.spec.model)
            if self.spec.model.init:
                from seqtrain.export.init import load_initial_weights

                self.log(load_initial_weights(self.model, self.spec.model.init))
            if self.spec.model.lora is not None:  # freeze the model, add adapters: only they train and are saved
                from seqtrain.models.lora import apply_lora

                n = apply_lora(self.model, self.spec.model.lora, self.spec.model.arch)
                self.log(f"LoRA: {n:,} trainable parameters (rank {self.spec.model.lora.rank})")
        elif order == "zero3":  # partitioned module by module as it is built, then the partitions initialised
            from seqtrain.engine.deepspeed import build_partitioned

            self.model = build_partitioned(self.job, self.ctx)
        else:
            self.model = new_model(self.spec.model)
        self.model = parallelize(self.model, self.job, self.ctx)  # tensor parallel (before AC / compile)
        if order is None:  # "fsdp2": FSDPEngine shards the meta model, then materialises only the shards
            materialize(self.model, self.ctx.device, local_modules(self.job, self.ctx.pp_size, self.ctx.pp_rank))
        self.log(setup_kernels(self.model, self.job, self.ctx.device))  # optimization.kernels -> model and loss
        self.log(setup_fused_projections(self.model, self.job))  # optimization.fusedProjections -> q/k/v, gate/up
        for line in prepare_model(self.model, self.job, self.ctx.device):  # activation checkpointing, compile
            self.log(line)
        engine = engine_name(self.job)
        self.phase(f"building the {engine} engine" + (" (DeepSpeed compiles its ops on first use)"
                                                      if engine == "deepspeed" else ""))
        self.engine = build_engine(self.model, self.job, self.ctx)
        self.phase("loading the data")
        self.data = build_train_data(self.job, self.ctx.dp_rank, self.ctx.dp_size)
        # the next step's batches are built on a background thread (pinned on CUDA) while this step runs
        self.prefetcher = Prefetcher(self.data, pin_memory=self.ctx.device.type == "cuda")
        self.io_timeout_s = io_timeout_seconds(self.spec.optimization.comm_timeout_seconds)
        self.checkpoints = CheckpointManager(self.runtime.checkpoint_dir, self.spec.checkpoint.keep, self.ctx,
                                             io_timeout_s=self.io_timeout_s)
        self.metrics_writer = MetricsWriter(os.path.join(self.runtime.workdir, "metrics.jsonl"))
        seed_all(tr.seed + 1 + self.ctx.rank)  # per-rank streams for dropout from here on
        self.resume()

    def resume(self) -> None:
        info = self.checkpoints.latest()
        while info is not None:
            self.phase(f"loading checkpoint step {info.step}")
            why = self._unusable(info)
            if why is None:
                break
            # A refused (planted pickle) or unreadable file: set the checkpoint aside, fall back to the previous one.
            self.checkpoints.quarantine(info, why)
            info = self.checkpoints.latest()
            if info is None:
                raise InvalidConfig(f"cannot resume: {why}; no earlier complete checkpoint (it was set aside as "
                                    f"{os.path.basename(self.runtime.checkpoint_dir)}/.bad-step-*; run again to "
                                    "start from scratch)")
        if self.ctx.is_main:
            os.makedirs(self.runtime.workdir, exist_ok=True)
            self.metrics_writer.truncate_after(self.step)
        if self.resumed_from is not None:
            self.saved_step, self.saved_wall = self.resumed_from.step, _epoch(self.resumed_from.time)
            seconds = self.resumed_from.meta.get("save_seconds")
            if isinstance(seconds, int | float):  # the previous attempt's measurement until this one saves
                self.interval.observe_save(float(seconds), "checkpoint")
            self._check_steps_change(self.resumed_from.meta.get("total_steps"))
        self.ctx.barrier()

    def _check_steps_change(self, planned: Any) -> None:
        """A checkpoint made for other training.steps: say what happens to the schedule, or refuse (every rank
        decides alike from the same checkpoint and spec, so all raise together)."""
        change = resume_steps_change(self.spec.training, self.step, planned)
        if change is None:
            return
        msg, refuse = change
        if refuse:
            raise InvalidConfig(f"spec.training.steps: {msg}")
        self.log(f"seqtrain: {msg}")

    # ---- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Rank-independent trainer state (rank 0 writes it)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "data": self.prefetcher.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.prefetcher.reset()  # a step built from the old position must not be handed out
        self.data.load_state_dict(state["data"])

    def _write_checkpoint(self, directory: str) -> list[str]:
        """This rank's files beside the engine's DCP tree: its RNG state, and on rank 0 the trainer state."""
        torch.save(rng_state(), os.path.join(directory, rng_file(self.ctx.rank)))
        files = [rng_file(self.ctx.rank)]
        if self.ctx.is_main:
            torch.save(self.state_dict(), os.path.join(directory, TRAINER_STATE))
            files.append(TRAINER_STATE)
        return files

    def save_checkpoint(self) -> CheckpointInfo | None:
        if self._saved is not None and self._saved.step == self.step:
            return self._saved  # this step is saved already (an evaluation's best checkpoint, then the interval's)
        meta = {
            "engine": self.engine.name,
            "layout": {"dp": self.ctx.dp_size, "tp": self.ctx.tp_size, "pp": self.ctx.pp_size},
            "total_steps": self.total_steps,
            "loss": self.last_metrics.get("loss"),
            "attempt": self.runtime.attempt,
            "job": self.job.to_dict(),  # self-describing: `seqtrain export/generate` rebuild the model from it
            # how long the previous save took: a restarted gang's SIGTERM check starts from it
            "save_seconds": self.checkpoints.last_save_seconds,
            "format": FORMAT,
        }
        # one DCP tree from every engine (any engine / dp size resumes it), written in the background when
        # checkpoint.asyncSave. Storage, not peers: the save has its own deadline (SEQTRAIN_CHECKPOINT_TIMEOUT_SECONDS), not the watchdog's
        started = time.monotonic()
        try:
            with waiting(f"checkpoint step-{self.step}: shard writes and the publishing barriers",
                         deadline_s=self.io_timeout_s + 60):
                info = self._saved = self.checkpoints.save(self.step, self._write_checkpoint, meta,
                                                           state=self.engine.checkpoint_state,
                                                           background=self.spec.checkpoint.async_save)
        finally:  # what training waited for, however the save is done (published as progress.checkpointSeconds)
            self.checkpoint_seconds += time.monotonic() - started
        if info is not None:
            # the time training stood still for this save, whatever the checkpoint layer does in the background:
            # the save cost of the Young/Daly interval
            self.ckpt_block_s = time.monotonic() - started
            self.interval.observe_save(self.ckpt_block_s)
            self.saved_at, self.saved_step, self.saved_wall = time.monotonic(), self.step, time.time()
            self._recompute_interval(log=True)
        return info

    def _recompute_interval(self, log: bool = False) -> None:
        """Rank 0, every step (the MTBF grows with failure-free time, the step time drifts); said on the console
        after a save when it moved by more than a quarter."""
        if not self.ctx.is_main:
            return
        now = self.interval.recompute(time.monotonic() - self.started_at)
        last = self._logged_interval
        if log and now is not None and self.interval.auto and (last is None or abs(now - last) > 0.25 * last):
            self._logged_interval = now
            r = self.interval.report()
            self.log(f"seqtrain: checkpoint interval {now} steps ({r['sources']['intervalSteps']}): save "
                     f"{r.get('saveSeconds', 0):.3g}s, step {r.get('stepSeconds', 0):.3g}s, gang MTBF "
                     f"{r['mtbfSeconds']:.4g}s ({r['sources']['mtbfSeconds']}, {self.interval.failures} failure(s))")

    def checkpoint_report(self) -> dict[str, Any]:
        """`checkpointPolicy` and `workAtRisk` for the progress document (rank 0; wire form)."""
        now = time.monotonic()
        at_risk: dict[str, Any] = {"checkpointStep": self.saved_step, "steps": self.step - self.saved_step,
                                   "seconds": round(now - self.saved_at, 3)}
        if self.saved_wall is not None:
            at_risk["checkpointAgeSeconds"] = round(max(0.0, time.time() - self.saved_wall), 3)
        return {"checkpointPolicy": self.interval.report(), "workAtRisk": at_risk}

    def save_seconds_estimate(self) -> float | None:
        """How long a save takes: this attempt's last one, else the one recorded in the checkpoint resumed from."""
        self.checkpoints.wait()  # an async save in flight is published first, and its whole duration measured
        if self.checkpoints.last_save_seconds is not None:
            return self.checkpoints.last_save_seconds
        seconds = (self.resumed_from.meta.get("save_seconds") if self.resumed_from else None)
        return float(seconds) if isinstance(seconds, int | float) else None

    def sigterm_save_allowed(self) -> tuple[bool, str]:
        """Whether a SIGTERM save fits in what is left of the grace period (SEQTRAIN_TERM_GRACE_SECONDS, set from
        the pod's terminationGracePeriodSeconds), judged by rank 0 from the last measured save; the same answer on
        every rank. A save the SIGKILL would cut wastes the grace period and leaves a .tmp folder."""
        verdict: tuple[bool, str] = (True, "")
        if self.ctx.is_main:
            raw = os.environ.get(GRACE_ENV, "").strip()
            need = self.save_seconds_estimate()
            try:
                grace = float(raw) if raw else None
            except ValueError:
                grace = None
            if grace is not None and need is not None:
                since = time.monotonic() - (self.terminate_time or time.monotonic())
                left = grace - since
                if need * SAVE_MARGIN > left:
                    last = self.resumed_from.step if self.resumed_from else 0
                    newest = self.checkpoints.latest_published_step()
                    verdict = (False, f"seqtrain: SIGTERM at step {self.step}: not saving a checkpoint: the last save "
                               f"took {need:.1f}s but only {max(0.0, left):.1f}s of the grace period ({GRACE_ENV}="
                               f"{raw}) are left; the next attempt resumes from step {newest or last} (raise the "
                               "pod's terminationGracePeriodSeconds to save on termination)")
                else:
                    verdict = (True, f"seqtrain: SIGTERM at step {self.step}: saving a checkpoint: the last save "
                               f"took {need:.1f}s, {left:.1f}s of the grace period ({GRACE_ENV}={raw}) are left")
            else:  # nothing to judge by: save
                verdict = (True, f"seqtrain: SIGTERM at step {self.step}: saving a checkpoint ("
                           + ("no save measured yet" if need is None else f"no grace period given in {GRACE_ENV}")
                           + ")")
        return self.ctx.broadcast_object(verdict)

    def _unusable(self, info: CheckpointInfo) -> str | None:
        """Load `info`; None when every rank did, else why not (the same answer on every rank). A rank that could
        not load it *now* (out of memory, CUDA or storage I/O error) makes every rank raise CheckpointUnavailable:
        the checkpoint is kept and the gang restarts as an infrastructure failure."""
        why: tuple[str, str] | None = None
        try:
            self.load_checkpoint(info)
        except UnusableCheckpoint as exc:
            why = ("unusable", str(exc))
        except CheckpointUnavailable as exc:
            why = ("unavailable", str(exc))
        answers: list[Any] = [why]
        if self.ctx.distributed:
            import torch.distributed as dist

            answers = [None] * self.ctx.world_size
            dist.all_gather_object(answers, why)  # plain strings
        found = [a for a in answers if a is not None]
        unavailable = [msg for kind, msg in found if kind == "unavailable"]
        if unavailable:
            raise CheckpointUnavailable(unavailable[0])
        return found[0][1] if found else None

    def load_checkpoint(self, info: CheckpointInfo) -> None:
        try:
            self.engine.load(info.path)
        except (UnusableCheckpoint, CheckpointUnavailable, InvalidConfig):
            raise
        except Exception as exc:
            # an engine's own failure of the moment (memory, device, storage I/O) keeps the checkpoint; anything
            # else propagates (a layout change is the job's, not the checkpoint's fault)
            from seqtrain.checkpoint.safe_load import classify, transient

            if transient(exc):
                raise classify(info.path, exc) from exc
            raise
        state_path = os.path.join(info.path, TRAINER_STATE)
        state = load_plain(state_path)
        if not isinstance(state, dict) or type(state.get("step")) is not int or not isinstance(state.get("data"), dict):
            raise UnusableCheckpoint(f"{state_path}: not seqtrain's trainer state (tampered, or not written by seqtrain)")
        try:  # plain values of any shape load weights_only: a wrong shape is the file's fault, not a crash
            self.load_state_dict(state)
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            raise UnusableCheckpoint(f"{state_path}: not seqtrain's trainer state ({type(exc).__name__})") from None
        rng_path = os.path.join(info.path, rng_file(self.ctx.rank))
        if os.path.exists(rng_path):
            try:
                set_rng_state(load_plain(rng_path))
            except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
                from seqtrain.checkpoint.safe_load import classify

                raise classify(rng_path, exc) from None
        else:  # resumed into more ranks than were saved: a fresh, still deterministic stream
            seed_all(self.spec.training.seed + 1 + self.ctx.rank + self.step)
        self.resumed_from = info

    def checkpoint_due(self) -> bool:
        return self.save_due or self.step >= self.total_steps

    def _save_due_here(self) -> bool:
        """Rank 0's answer for the step just trained (the others' is ignored: the all-reduce takes rank 0's)."""
        if not self.ctx.is_main:
            return False
        self._recompute_interval()
        return self.interval.due(self.step, self.step - self.saved_step, time.monotonic() - self.saved_at)

    # ---- one step ----------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        micro_batches = self.prefetcher.next_step()
        lr = self.engine.lr  # the rate this step uses (the schedule advances inside engine.step)
        with waiting(f"step {self.step + 1}: forward/backward and gradient reduction ({self.engine.name} engine, "
                     f"dp {self.ctx.dp_size} x pp {self.ctx.pp_size} x tp {self.ctx.tp_size})"):
            stats = self.engine.step(micro_batches)
        self.step += 1
        self.tokens_seen += stats.target_tokens
        restart.mark_stepped()  # tells the launcher this incarnation got past start-up (in-place restarts)
        self.interval.observe_step(time.perf_counter() - t0)
        faults.maybe_kill_after_step(self.step, self.ctx.rank)
        faults.maybe_fail_at_rate(self.ctx.rank)
        if faults.term_requested_at(self.step):
            self.terminate_signal = True
        if self.terminate_signal and self.terminate_time is None:
            self.terminate_time = time.monotonic()
        with waiting(f"step {self.step}: the end-of-step all-reduce (memory peak, stop flags) over all ranks"):
            mem_mb = self.agree()
        return self.step_metrics(stats, lr, time.perf_counter() - t0, mem_mb)

    def agree(self) -> float:
        """One MAX all-reduce per step: the busiest rank's memory peak and whether any rank must stop."""
        # Host values only. A single process keeps them on the host (no device sync); a distributed run needs
        # them on the collective's device, and reading the result is the step's second host sync (all ranks
        # must agree on stopping before the next step starts).
        flags = torch.tensor(
            [peak_memory_mb(self.ctx.device), float(self.terminate_signal), float(self.stop_training),
             float(self._save_due_here())],
            dtype=torch.float64, device=self.ctx.device if self.ctx.distributed else "cpu",
        )
        self.ctx.all_reduce(flags, op="max")
        self.terminate_requested = bool(flags[1] > 0)
        self.stop_training = bool(flags[2] > 0)
        self.save_due = bool(flags[3] > 0)  # rank 0's clock decides for time- and measurement-based intervals
        return float(flags[0])

    def step_metrics(self, stats: StepStats, lr: float, seconds: float, mem_mb: float) -> dict[str, Any]:
        m: dict[str, Any] = {
            "step": self.step,
            "loss": stats.loss,
            "lr": lr,
            "grad_norm": stats.grad_norm,
            "tokens": stats.target_tokens,
            "slots": stats.slots,
            "tokens_per_s": stats.target_tokens / seconds if seconds > 0 else None,
            "step_time_s": seconds,
            "mem_peak_mb": round(mem_mb, 1),
            "time": time.time(),
        }
        if stats.loss_scale is not None:
            m["loss_scale"] = stats.loss_scale
        if stats.skipped:
            m["skipped"] = True
        return m

    # ---- the loop ----------------------------------------------------------------------------------------
    def run(self) -> str:
        self.engine.train()
        self.callbacks.on_train_start(self)
        self.log_start()
        self.phase("first step (compile, warm-up)")
        reason = "completed"
        while self.step < self.total_steps:
            metrics = self.train_step()
            self.last_metrics = metrics
            self.callbacks.on_step_end(self, self.step, metrics)
            # saved before the step's line is written, so the line carries what the save held training up
            if (self.checkpoint_due() and not (self.terminate_requested or self.stop_training)
                    and self.save_checkpoint() is not None and self.checkpoints.last_block_seconds is not None):
                metrics["ckpt_block_s"] = round(self.checkpoints.last_block_seconds, 4)
                if self.checkpoints.last_wait_seconds:  # of it, waiting for the previous async save's write
                    metrics["ckpt_wait_s"] = round(self.checkpoints.last_wait_seconds, 4)
            if self.ctx.is_main:
                self.metrics_writer.append(metrics)
                self.log_step(metrics)
            if faults.hold_after_step(self.step, lambda: self.terminate_signal):  # tests only (unset normally)
                self.agree()  # the signal that ended the hold, agreed by every rank (all held at this step)
            if self.terminate_requested or self.stop_training:
                reason = "terminated" if self.terminate_requested else "stopped"
                if reason == "stopped":
                    self.save_checkpoint()
                elif self.spec.checkpoint.save_on_sigterm:
                    allowed, why = self.sigterm_save_allowed()
                    self.log(why)
                    if allowed and self.save_checkpoint() is not None:
                        since = time.monotonic() - (self.terminate_time or time.monotonic())
                        self.log(f"seqtrain: SIGTERM save of step {self.step} done in {self.ckpt_block_s or 0:.1f}s, "
                                 f"{since:.1f}s after the signal")
                break
        # the last background write is published before the run reports its end, and the writer process stops (a rank
        # that fails instead takes its writer with it: PR_SET_PDEATHSIG, see seqtrain.checkpoint.writer)
        self.checkpoints.close()
        self.prefetcher.close()
        self.callbacks.on_train_end(self, reason)
        self.log_end(reason)
        return reason

    # ---- console -----------------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        if self.ctx.is_main:
            print(text, flush=True)

    def phase(self, what: str) -> None:
        if self.ctx.is_main:
            announce_phase(what)

    def log_start(self) -> None:
        s = self.spec
        where = f"resumed from step {self.resumed_from.step}" if self.resumed_from else "fresh start"
        self.log(
            f"seqtrain: {self.job.name} attempt {self.runtime.attempt}, {where}; {s.model.arch} "
            f"{count_parameters(self.model) / 1e6:.2f}M params, world {self.ctx.world_size} "
            f"({self.ctx.backend or 'single process'}, {self.ctx.device.type}), engine {engine_name(self.job)}, "
            f"{self.data.num_sequences} train sequences of {s.data.seq_len}, "
            f"global batch {self.data.global_batch} = {s.training.micro_batch_size} x {self.data.accum} accum "
            f"x {self.ctx.dp_size} dp"
        )

    def log_step(self, m: dict[str, Any]) -> None:
        if m["step"] % self.spec.training.log_every and m["step"] != self.total_steps:
            return
        self.log(
            f"step {m['step']}/{self.total_steps} loss {m['loss']:.4f} lr {m['lr']:.2e} "
            f"grad_norm {m['grad_norm']:.3f} tok/s {m['tokens_per_s'] or 0:.0f} mem {m['mem_peak_mb']:.0f}MB"
        )

    def log_end(self, reason: str) -> None:
        self.log(f"seqtrain: {reason} at step {self.step}/{self.total_steps}")
