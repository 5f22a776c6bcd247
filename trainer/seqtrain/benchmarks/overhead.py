"""Measure what observability costs per optimizer step: `python -m seqtrain.benchmarks.overhead [--steps N] [--out F]`.

Runs the same single-rank job in this process under three settings, interleaved over several rounds so machine
noise hits all of them alike:
  bare    - no observability callbacks (metrics.jsonl only)
  metrics - throughput/MFU, TensorBoard (incl. per-group grad norms), Prometheus /metrics, progress endpoint
  eval    - metrics + evaluation every `--eval-every` steps on `--eval-batches` micro-batches
What each step spends outside the training step proper (callbacks, metrics.jsonl, logging) is the wall time
between consecutive metrics.jsonl records minus the next record's `step_time_s`: measured this way it does not
drown in the noise of the step itself on a shared machine. Mean over the steps after a warm-up (so evaluation
steps count, amortised), median for the typical step. Writes JSON with per-round figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch

from seqtrain.spec import RuntimeConfig, load_job, resolve

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: overhead}
spec:
  model: {arch: gpt, preset: mini}
  data: {source: builtin, seqLen: 128}
  training: {steps: 10, globalBatchSize: 8, microBatchSize: 8}
  checkpoint: {intervalSteps: 100000, keep: 1}
"""


def _run(setting: str, steps: int, eval_every: int, eval_batches: int, warmup: int) -> dict[str, float]:
    from seqtrain.runtime.dist import DistContext
    from seqtrain.train.callbacks import build_callbacks
    from seqtrain.train.loop import Trainer

    overrides = [f"training.steps={steps}", "training.logEvery=1000000"]
    if setting == "eval":
        overrides += [f"training.eval.every={eval_every}", f"training.eval.batches={eval_batches}"]
    job = resolve(load_job(JOB, overrides))
    with tempfile.TemporaryDirectory() as tmp:
        runtime = RuntimeConfig(workdir=tmp, checkpoint_dir=os.path.join(tmp, "ckpt"),
                                metrics_port=0 if setting != "bare" else None, progress_port=0 if setting != "bare" else None)
        trainer = Trainer(job, runtime, DistContext())
        timings: dict[str, list[float]] = {}
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.setup()
            if setting != "bare":
                for cb in build_callbacks(trainer):
                    trainer.callbacks.append(_timed(cb, timings))
            trainer.run()
        with open(os.path.join(tmp, "metrics.jsonl"), encoding="utf-8") as f:
            recs = [json.loads(line) for line in f]
    recs = recs[warmup:]
    gaps = [b["time"] - a["time"] - b["step_time_s"] for a, b in zip(recs, recs[1:], strict=False)]
    evals = [r["eval_time_s"] for r in recs if "eval_time_s" in r]
    return {"median_outside_step_s": statistics.median(gaps), "mean_outside_step_s": statistics.fmean(gaps),
            "median_train_step_s": statistics.median(r["step_time_s"] for r in recs),
            "mean_eval_s": statistics.fmean(evals) if evals else 0.0,
            "callback_median_ms": {k: 1e3 * statistics.median(v[warmup:]) for k, v in timings.items()}}


def _timed(cb: Any, timings: dict[str, list[float]]) -> Any:
    """Time the callback's on_step_end (evaluation included for the Evaluation callback)."""
    inner = cb.on_step_end

    def on_step_end(*args: Any) -> None:
        t0 = time.perf_counter()
        inner(*args)
        timings.setdefault(type(cb).__name__, []).append(time.perf_counter() - t0)

    cb.on_step_end = on_step_end
    return cb


def summarize(rounds: list[dict[str, Any]], eval_every: int) -> dict[str, Any]:
    """Costs per step in seconds (medians over rounds) and as a share of the typical training step (the median
    over every run: on a shared machine the step time of one setting alone swings with the neighbours' load)."""
    settings = ("bare", "metrics", "eval")

    def med(setting: str, key: str) -> float:
        return statistics.median(x[setting][key] for x in rounds)

    step_s = statistics.median(x[s]["median_train_step_s"] for x in rounds for s in settings)
    metrics_cost = med("metrics", "mean_outside_step_s") - med("bare", "mean_outside_step_s")
    eval_cost = med("eval", "mean_outside_step_s") - med("metrics", "mean_outside_step_s")
    return {
        "train_step_s": step_s,
        "outside_step_s": {s: med(s, "mean_outside_step_s") for s in settings},
        "metrics_cost_s_per_step": metrics_cost,
        "metrics_overhead_pct": 100 * metrics_cost / step_s,
        "eval_s": med("eval", "mean_eval_s"),
        "eval_cost_s_per_step": eval_cost,
        "eval_overhead_pct": 100 * eval_cost / step_s,
        "eval_cost_per_evaluation_in_steps": med("eval", "mean_eval_s") / step_s,
        "metrics_callback_median_ms": {
            name: statistics.median(x["metrics"]["callback_median_ms"][name] for x in rounds)
            for name in rounds[0]["metrics"]["callback_median_ms"]
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqtrain.benchmarks.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="obs-overhead.json")
    a = p.parse_args(argv)
    settings = ("bare", "metrics", "eval")
    rounds: list[dict[str, Any]] = []
    for r in range(a.rounds):
        row = {s: _run(s, a.steps, a.eval_every, a.eval_batches, a.warmup) for s in settings}
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(
            f"{s} step {row[s]['median_train_step_s'] * 1e3:.1f} ms + {row[s]['mean_outside_step_s'] * 1e3:.2f} ms"
            for s in settings))

    result = {
        "job": "gpt mini, seqLen 128, batch 8, 1 CPU process",
        "torch": torch.__version__, "machine": platform.platform(), "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"), "steps": a.steps, "rounds": a.rounds,
        "eval_every": a.eval_every, "eval_batches": a.eval_batches,
        **summarize(rounds, a.eval_every),
        "rounds_detail": rounds,
    }
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "rounds_detail"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
