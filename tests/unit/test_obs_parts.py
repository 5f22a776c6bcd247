"""Small parts of seqtrain.obs on their own: early stopping, progress endpoint, Prometheus names, grad-norm groups."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from seqtrain.obs.progress import ProgressReporter
from seqtrain.obs.prometheus import TrainerMetrics
from seqtrain.obs.tensorboard import GroupGradNorms, layer_group
from seqtrain.train.early_stop import EarlyStopper


def test_early_stopper_counts_evaluations_without_improvement() -> None:
    s = EarlyStopper(patience=2, min_delta=0.1)
    assert s.update(10, 3.0) and s.best_step == 10
    assert not s.update(20, 2.95)  # better, but not by more than min_delta
    assert not s.should_stop
    assert s.update(30, 2.8) and s.bad_evals == 0  # a real improvement resets the count
    assert not s.update(40, 2.9) and not s.update(50, 2.85)
    assert s.should_stop and "best 2.8000 at step 30" in s.reason()
    assert not EarlyStopper(patience=None).should_stop


def test_early_stopper_replay_gives_the_same_state() -> None:
    history = [(5, 4.0), (10, 3.5), (15, 3.6), (20, 3.4), (25, 3.45)]
    live, replayed = EarlyStopper(3, 0.0), EarlyStopper(3, 0.0)
    for step, loss in history:
        live.update(step, loss)
    for step, loss in history:  # what a resumed run does with metrics.jsonl
        replayed.update(step, loss)
    assert (live.best_loss, live.best_step, live.bad_evals) == (replayed.best_loss, replayed.best_step, 1)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_progress_reporter_serves_and_mirrors_status_progress(tmp_path: Path) -> None:
    rep = ProgressReporter(str(tmp_path), total_steps=100, port=0, addr="127.0.0.1")
    try:
        rep.update(step=7, loss=2.5, tokens_per_second=1234.0, val_loss=2.7)
        code, body = _get(f"http://127.0.0.1:{rep.port}/progress")
        assert code == 200
        served = json.loads(body)
        assert served == json.loads((tmp_path / "progress.json").read_text())
        assert served["step"] == 7 and served["totalSteps"] == 100 and served["valLoss"] == 2.7
        assert served["tokensPerSecond"] == 1234.0 and served["updatedAt"].endswith("Z")
        assert _get(f"http://127.0.0.1:{rep.port}/nope")[0] == 404
    finally:
        rep.close()


def test_prometheus_names_follow_conventions() -> None:
    m = TrainerMetrics("job-a", rank=1, info={"arch": "gpt"})
    m.observe_step(3, {"loss": 2.0, "tokens": 512, "mem_peak_mb": 2.0, "step_time_s": 0.2, "mfu": 0.4})
    m.observe_eval({"val_loss": 2.2, "eval_time_s": 0.1})
    port = m.serve(0, addr="127.0.0.1")
    try:
        assert port
        code, text = _get(f"http://127.0.0.1:{port}/metrics")
    finally:
        m.close()
    assert code == 200
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    lv = '{job="job-a",rank="1"}'
    assert lines[f"seqtrain_steps_total{lv}"] == 1 and lines[f"seqtrain_tokens_total{lv}"] == 512
    assert lines[f"seqtrain_memory_peak_bytes{lv}"] == 2 * 2**20  # base unit: bytes
    assert lines[f"seqtrain_mfu_ratio{lv}"] == 0.4 and lines[f"seqtrain_validation_loss{lv}"] == 2.2
    assert lines[f"seqtrain_step_duration_seconds_count{lv}"] == 1
    assert lines[f"seqtrain_evaluations_total{lv}"] == 1


def test_group_grad_norms_rescale_to_before_clipping() -> None:
    assert layer_group("blocks.3.attn.q.weight") == "blocks.3" and layer_group("embed.weight") == "embed"
    model = torch.nn.ModuleDict({"embed": torch.nn.Linear(4, 4), "head": torch.nn.Linear(4, 2)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = GroupGradNorms(model, opt)
    model["head"](model["embed"](torch.randn(3, 4))).pow(2).sum().backward()
    raw = {g: float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ps]))) for g, ps in norms.groups.items()}
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01))  # clips hard
    norms.armed = True
    opt.step()
    got = norms.take(total)
    assert got == pytest.approx(raw, rel=1e-5)
    assert norms.take(total) == {}  # each step's norms are read once


def test_trainer_pods_can_be_scraped() -> None:
    from seqtrain.spec import SeqTrainJob
    from seqtrain_operator.k8s.owner import Owner
    from seqtrain_operator.k8s.pods import manifests as m

    job = SeqTrainJob.model_validate({"metadata": {"name": "gpt"}, "spec": {"resources": {"gpus": 2}}})
    pod = m.build_pod(job, Owner(name="gpt", namespace="ml", uid="u"), 1, 0, m.Settings(metrics_port=9400))
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9400"
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == 9400 and ports["metrics-1"] == 9401  # one per local rank
    plain = m.build_pod(job, Owner(name="gpt", namespace="ml", uid="u"), 1, 0, m.Settings(metrics_port=None))
    assert "prometheus.io/scrape" not in plain["metadata"].get("annotations", {})


def test_validation_batches_score_what_training_scores() -> None:
    """Synthetic tasks score only the answers: evaluation must ignore the same positions training does."""
    from types import SimpleNamespace

    from seqtrain.data import load_corpus
    from seqtrain.spec import load_job, resolve
    from seqtrain.train.evaluation import Evaluation

    job = resolve(load_job("""
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: syn}
spec:
  data: {source: synthetic, seqLen: 80, synthetic: {task: copy, length: 16}}
  training: {globalBatchSize: 4, microBatchSize: 4, eval: {every: 5, batches: 2}}
"""))
    trainer = SimpleNamespace(spec=job.spec, job=job, ctx=SimpleNamespace(dp_size=1, dp_rank=0))
    ev = Evaluation(trainer)  # type: ignore[arg-type]
    assert not ev.byte_level  # no bits-per-byte for a synthetic vocabulary
    batches = ev._all_batches(trainer, load_corpus(job, "validation"))  # type: ignore[arg-type]
    assert len(batches) == 2 and batches[0].tokens.shape[0] == 4  # one example per row
    scored = sum(int(b.num_targets()) for b in batches)
    assert 0 < scored < sum(b.targets.numel() for b in batches) // 2  # answers only, not the prompts
