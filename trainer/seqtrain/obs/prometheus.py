"""Prometheus `/metrics` of one trainer rank (prometheus-client), on `runtime.metricsPort + local rank`.

Names follow Prometheus conventions: a `seqtrain_` prefix, base units in the name (`_seconds`, `_bytes`),
`_total` for counters, `_ratio` for fractions. Every series carries `job` (the SeqTrainJob name) and `rank`
labels, so one scrape config covers all ranks of all jobs. A private registry per process keeps the default
registry's process/GC collectors out of the way of tests that start several servers in one interpreter.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from seqtrain.obs.httpserve import serve

# Step times from milliseconds (tiny CPU models) to minutes (large models with accumulation).
_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class TrainerMetrics:
    """The series one rank exports; `observe_step` / `observe_eval` update them from the loop's metrics dict."""

    def __init__(self, job: str, rank: int, info: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("job", "rank")
        self._lv = {"job": job, "rank": str(rank)}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        self.info = Gauge("seqtrain_job_info", "Constant 1; labels describe the run.", [*labels, *(info or {})], registry=r)
        self.info.labels(**self._lv, **(info or {})).set(1)
        self.step = gauge("seqtrain_step", "Last completed optimizer step.")
        self.steps = Counter("seqtrain_steps", "Optimizer steps completed by this process.", labels, registry=r)
        self.tokens = Counter("seqtrain_tokens", "Real (non-padding) tokens trained on, all ranks.", labels, registry=r)
        self.loss = gauge("seqtrain_loss", "Training loss (mean over the global batch) of the last step.")
        self.lr = gauge("seqtrain_learning_rate", "Learning rate of the last step.")
        self.grad_norm = gauge("seqtrain_grad_norm", "Global L2 norm of the gradients before clipping.")
        self.tokens_per_s = gauge("seqtrain_tokens_per_second", "Real tokens per second of the last step, all ranks.")
        self.mem = gauge("seqtrain_memory_peak_bytes", "Peak memory of the busiest rank (CUDA allocator or RSS).")
        self.loss_scale = gauge("seqtrain_loss_scale", "fp16 dynamic loss scale.")
        self.mfu = gauge("seqtrain_mfu_ratio", "Model FLOPs utilisation (0..1) of the last step.")
        self.hfu = gauge("seqtrain_hfu_ratio", "Hardware FLOPs utilisation (0..1), recomputation included.")
        self.skipped = Counter("seqtrain_skipped_steps", "Steps skipped for non-finite gradients.", labels, registry=r)
        self.step_time = Histogram(
            "seqtrain_step_duration_seconds", "Wall time of one optimizer step.", labels, buckets=_STEP_BUCKETS, registry=r
        )
        self.val_loss = gauge("seqtrain_validation_loss", "Validation loss of the last evaluation.")
        self.val_bpb = gauge("seqtrain_validation_bits_per_byte", "Validation bits per byte (byte-level data).")
        self.best_val_loss = gauge("seqtrain_validation_loss_best", "Lowest validation loss so far.")
        self.evals = Counter("seqtrain_evaluations", "Evaluations run by this process.", labels, registry=r)
        self.eval_time = Histogram(
            "seqtrain_eval_duration_seconds", "Wall time of one evaluation.", labels, buckets=_STEP_BUCKETS, registry=r
        )
        self.checkpoint_stall = gauge("seqtrain_checkpoint_stall_seconds", "Time this process's training loop "
                                      "was blocked on checkpoint saves (status.lostSeconds.checkpointStall).")
        self._server: Any = None

    def observe_step(self, step: int, m: dict[str, Any]) -> None:
        lv = self._lv
        self.step.labels(**lv).set(step)
        self.steps.labels(**lv).inc()
        self.tokens.labels(**lv).inc(float(m.get("tokens") or 0))
        for gauge, key, scale in (
            (self.loss, "loss", 1.0), (self.lr, "lr", 1.0), (self.grad_norm, "grad_norm", 1.0),
            (self.tokens_per_s, "tokens_per_s", 1.0), (self.mem, "mem_peak_mb", 2.0**20),
            (self.loss_scale, "loss_scale", 1.0), (self.mfu, "mfu", 1.0), (self.hfu, "hfu", 1.0),
        ):
            value = m.get(key)
            if isinstance(value, (int, float)):
                gauge.labels(**lv).set(float(value) * scale)
        if m.get("skipped"):
            self.skipped.labels(**lv).inc()
        if isinstance(m.get("step_time_s"), (int, float)):
            self.step_time.labels(**lv).observe(float(m["step_time_s"]))

    def observe_checkpoint_stall(self, seconds: float) -> None:
        self.checkpoint_stall.labels(**self._lv).set(seconds)

    def observe_eval(self, m: dict[str, Any]) -> None:
        lv = self._lv
        self.evals.labels(**lv).inc()
        for gauge, key in ((self.val_loss, "val_loss"), (self.val_bpb, "val_bpb"), (self.best_val_loss, "best_val_loss")):
            if isinstance(m.get(key), (int, float)):
                gauge.labels(**lv).set(float(m[key]))
        if isinstance(m.get("eval_time_s"), (int, float)):
            self.eval_time.labels(**lv).observe(float(m["eval_time_s"]))

    def serve(self, port: int, addr: str = "0.0.0.0") -> int | None:
        """Start the HTTP server (port 0: any free port); return the bound port, or None (with a warning) when
        the port is taken: training goes on unobserved rather than failing."""
        def metrics() -> tuple[int, str, bytes]:
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)

        # prometheus-client's own server starts a thread per connection with no timeout: ours is bounded
        self._server = serve(port, addr, {"/metrics": metrics, "/": metrics}, "/metrics")
        return int(self._server.server_address[1]) if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
