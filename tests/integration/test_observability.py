"""Evaluation, early stopping, best checkpoint, TensorBoard, Prometheus, progress and profiling in real runs.

One `seqtrain run` (2 rank processes, gloo) carries most checks, so the suite pays for process start-up once;
an in-process single-rank run checks the HTTP endpoints deterministically from inside a callback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from seqtrain.data import eval_batches, load_corpus
from seqtrain.models import build_model
from seqtrain.models.loss import CausalLMLoss
from seqtrain.spec import RuntimeConfig, load_job, resolve

DEADLINE_S = 150

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: obs}
spec:
  replicas: 2
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 64}
  training:
    steps: 40
    globalBatchSize: 8
    microBatchSize: 4
    # minDelta 1 nat cannot be met in 5 steps: evaluations at 5, 10, 15; the 2nd miss stops the job at 15
    eval: {every: 5, batches: 3, earlyStopping: {patience: 2, minDelta: 1.0}}
    profile: {startStep: 2, steps: 2}
  checkpoint: {intervalSteps: 10, keep: 1}
"""


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback only
        return r.read().decode()


def _metric(text: str, name: str, rank: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'rank="{rank}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _metrics_lines(workdir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def early_stopped_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the job with `seqtrain run`; while it trains, scrape every rank's /metrics and rank 0's /progress."""
    tmp = tmp_path_factory.mktemp("obs")
    (tmp / "job.yaml").write_text(JOB)
    workdir = tmp / "run"
    # A 3 s pause inside the step-10 checkpoint save keeps the ranks alive for the scrape on a fast machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SEQTRAIN_FAULT_IN_SAVE": "sleep:3", "SEQTRAIN_FAULT_SAVE_STEP": "10"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "seqtrain_operator.cli", "run", str(tmp / "job.yaml"), "--workdir", str(workdir), "-q"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    scraped: dict[str, str] = {}
    end = time.monotonic() + DEADLINE_S
    try:
        while proc.poll() is None and time.monotonic() < end and len(scraped) < 3:
            for rank in (0, 1):
                ep = workdir / "endpoints" / f"rank-{rank}.json"
                if f"metrics{rank}" in scraped or not ep.exists():
                    continue
                port = json.loads(ep.read_text()).get("metrics_port")
                try:
                    text = _get(f"http://127.0.0.1:{port}/metrics")
                except OSError:
                    continue
                if (_metric(text, "seqtrain_step", str(rank)) or 0) >= 1:  # a step has been observed
                    scraped[f"metrics{rank}"] = text
                    if rank == 0:
                        progress_port = json.loads(ep.read_text())["progress_port"]
                        scraped["progress"] = _get(f"http://127.0.0.1:{progress_port}/progress")
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=max(1.0, end - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"workdir": workdir, "rc": proc.returncode, "out": out, "scraped": scraped}


@pytest.mark.slow
def test_early_stopping_ends_the_job_succeeded_with_a_reason(early_stopped_run: dict[str, Any]) -> None:
    run = early_stopped_run
    assert run["rc"] == 0, run["out"]
    status = json.loads((run["workdir"] / "status.json").read_text())
    assert status["phase"] == "Succeeded"
    done = next(c for c in status["conditions"] if c["type"] == "Succeeded")
    assert done["reason"] == "EarlyStopped"
    assert "did not improve" in done["message"]
    assert status["progress"]["step"] == 15 and status["progress"]["stopReason"] == "EarlyStopped"
    assert status["progress"]["bestStep"] == 5 and "valLoss" in status["progress"]
    assert _metrics_lines(run["workdir"])[-1]["step"] == 15


@pytest.mark.slow
def test_eval_runs_on_schedule_on_held_out_data(early_stopped_run: dict[str, Any]) -> None:
    workdir = early_stopped_run["workdir"]
    lines = _metrics_lines(workdir)
    evals = {r["step"]: r for r in lines if "val_loss" in r}
    assert sorted(evals) == [5, 10, 15]
    for r in evals.values():
        assert r["val_perplexity"] == pytest.approx(2.718281828 ** r["val_loss"], rel=1e-6)
        assert r["val_bpb"] == pytest.approx(r["val_loss"] / 0.6931471805599453, rel=1e-9)
        assert r["val_tokens"] == 3 * 4 * 64  # 3 micro-batches of 4 x 64 targets, shared by the 2 ranks

    # Recompute step 5's validation loss from its (best, kept) checkpoint on the validation split alone.
    job = resolve(load_job(JOB))
    model = build_model(job.spec.model)
    from seqtrain.parallel.consolidate import consolidate

    model.load_state_dict(consolidate(str(workdir / "checkpoints" / "step-5")))
    loss_fn = CausalLMLoss(model).eval()
    val = load_corpus(job, "validation")
    total, count = 0.0, 0
    with torch.no_grad():
        for b in eval_batches(val, 64, 4, 3):
            total += float(loss_fn(b.tokens, b.targets))
            count += b.targets.numel()
    assert evals[5]["val_loss"] == pytest.approx(total / count, rel=1e-5)

    # ... and that split shares no document with what the training reads.
    train = load_corpus(job, "train")

    def docs(corpus: Any) -> set[bytes]:
        ends = list(corpus.doc_starts[1:]) + [len(corpus)]
        return {corpus.tokens[s:e].tobytes() for s, e in zip(corpus.doc_starts, ends, strict=True) if e - s > 256}

    assert not docs(val) & docs(train)


@pytest.mark.slow
def test_best_checkpoint_is_kept_beyond_keep_and_marked(early_stopped_run: dict[str, Any]) -> None:
    ckpt = early_stopped_run["workdir"] / "checkpoints"
    # keep: 1 keeps the latest (15: saved on stop); 5 is the best by validation loss; 10 was pruned
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == ["step-15", "step-5"]
    best = json.loads((ckpt / "best.json").read_text())
    assert best["step"] == 5 and best["path"] == "step-5"
    evals = {r["step"]: r["val_loss"] for r in _metrics_lines(early_stopped_run["workdir"]) if "val_loss" in r}
    assert best["val_loss"] == pytest.approx(evals[5])


@pytest.mark.slow
def test_tensorboard_events_have_the_expected_tags(early_stopped_run: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(early_stopped_run["workdir"] / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s",
                "perf/model_tflops", "memory/peak_mb", "val/loss", "val/perplexity", "val/bits_per_byte",
                "grad_norm/embed", "grad_norm/blocks.0", "grad_norm/blocks.1", "grad_norm/norm"}
    assert expected <= tags, expected - tags
    assert [e.step for e in acc.Scalars("val/loss")] == [5, 10, 15]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 16))
    lines = _metrics_lines(early_stopped_run["workdir"])
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([r["loss"] for r in lines], rel=1e-6)
    # per-group norms are the pre-clipping split of the global norm
    step3 = {t: next(e.value for e in acc.Scalars(t) if e.step == 3) for t in tags if t.startswith("grad_norm/")}
    assert sum(v * v for v in step3.values()) ** 0.5 == pytest.approx(lines[2]["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_metrics_and_progress_were_served_during_the_run(early_stopped_run: dict[str, Any]) -> None:
    scraped = early_stopped_run["scraped"]
    assert set(scraped) == {"metrics0", "metrics1", "progress"}, early_stopped_run["out"]
    for rank in ("0", "1"):
        text = scraped[f"metrics{rank}"]
        for name in ("seqtrain_step", "seqtrain_loss", "seqtrain_learning_rate", "seqtrain_grad_norm",
                     "seqtrain_tokens_per_second", "seqtrain_memory_peak_bytes", "seqtrain_steps_total",
                     "seqtrain_tokens_total", "seqtrain_step_duration_seconds_count"):
            assert _metric(text, name, rank) is not None, (name, rank)
        assert f'seqtrain_job_info{{arch="gpt",attempt="1",job="obs",rank="{rank}",world_size="2"}} 1.0' in text
        assert _metric(text, "seqtrain_steps_total", rank) == _metric(text, "seqtrain_step", rank)
    progress = json.loads(scraped["progress"])
    assert progress["totalSteps"] == 40 and progress["step"] >= 1 and "updatedAt" in progress


@pytest.mark.slow
def test_profile_trace_is_valid_json_with_events(early_stopped_run: dict[str, Any]) -> None:
    for rank in (0, 1):
        path = early_stopped_run["workdir"] / "profile" / f"attempt1-rank{rank}.trace.json"
        trace = json.loads(path.read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert len(trace["traceEvents"]) > 100
        assert any("aten::mm" in str(n) or "aten::addmm" in str(n) for n in names)


@pytest.mark.slow
def test_report_of_the_run(early_stopped_run: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from seqtrain.obs.report import report_command

    workdir = early_stopped_run["workdir"]
    assert report_command(str(workdir)) == 0
    assert (workdir / "report.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "Succeeded (EarlyStopped)" in out and "15 / 40" in out


def test_endpoints_in_process(tmp_path: Path) -> None:
    """Single rank in this process: scrape /metrics and /progress from inside the step-2 callback, so the
    check does not depend on timing."""
    from seqtrain.runtime.callbacks import BaseCallback
    from seqtrain.runtime.dist import DistContext
    from seqtrain.train.callbacks import build_callbacks
    from seqtrain.train.loop import Trainer

    job = resolve(load_job(JOB, ["replicas=1", "training.steps=3", "training.profile=null",
                                 "training.eval.earlyStopping=null", "training.eval.every=2", "training.eval.batches=1"]))
    runtime = RuntimeConfig(workdir=str(tmp_path), checkpoint_dir=str(tmp_path / "ckpt"), metrics_port=0, progress_port=0)
    seen: dict[str, str] = {}

    class Scrape(BaseCallback):
        def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
            if step == 2:
                ep = json.loads((tmp_path / "endpoints" / "rank-0.json").read_text())
                seen["metrics"] = _get(f"http://127.0.0.1:{ep['metrics_port']}/metrics")
                seen["progress"] = _get(f"http://127.0.0.1:{ep['progress_port']}/progress")

    trainer = Trainer(job, runtime, DistContext())
    trainer.setup()
    for cb in [*build_callbacks(trainer), Scrape()]:
        trainer.callbacks.append(cb)
    assert trainer.run() == "completed"
    assert _metric(seen["metrics"], "seqtrain_step", "0") == 2
    assert _metric(seen["metrics"], "seqtrain_validation_loss", "0") is not None  # step 2 evaluated
    assert _metric(seen["metrics"], "seqtrain_evaluations_total", "0") == 1
    progress = json.loads(seen["progress"])
    assert progress["step"] == 2 and progress["totalSteps"] == 3 and "valLoss" in progress
    assert "mfu" not in progress  # CPU: no peak, no invented MFU
    final = json.loads((tmp_path / "progress.json").read_text())
    assert final["step"] == 3 and "stopReason" not in final
    assert final["lastCheckpoint"]["step"] == 3  # for an operator that cannot list the checkpoint folder
    with pytest.raises(OSError):  # servers are closed with the run
        _get(f"http://127.0.0.1:{json.loads((tmp_path / 'endpoints' / 'rank-0.json').read_text())['metrics_port']}/metrics")
