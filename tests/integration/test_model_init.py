"""`model.init` round trip: train, export, start a new job from the export: its first step's loss is the
original model's loss on that batch (fp32, CPU, one process); a job from the checkpoint itself agrees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from parity_util import job_for, logs, losses, run_ranks

from seqtrain.data import build_train_data
from seqtrain.export.weights import load_source
from seqtrain.export.writer import export
from seqtrain.models import build_model
from seqtrain.models.loss import CausalLMLoss

pytestmark = pytest.mark.slow
BASE = {"model.kvHeads": 2, "model.tieEmbeddings": False, "training.seed": 11}


def first_step_loss_of(weights_dir: str, job) -> float:  # noqa: ANN001
    """Loss of the weights at `weights_dir` on `job`'s first global batch, the way the engine reduces it."""
    w = load_source(weights_dir)
    model = build_model(job.spec.model).eval()
    model.load_state_dict(w.state, strict=True)
    loss = CausalLMLoss(model)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in build_train_data(job, 0, 1).next_step():
            total += float(loss(b.tokens, b.targets, b.doc_ids))
            count += int(b.num_targets())
    return total / count


def test_init_from_an_export_starts_at_the_original_loss(tmp_path: Path) -> None:
    orig = tmp_path / "orig"
    job = job_for({**BASE, "training.steps": 3})
    assert run_ranks(job, orig, 1) == [0], logs(orig)
    out = tmp_path / "export"
    export(str(orig), str(out))
    # a different data order (seed) than the original run, so step 1 sees a batch the original never saw first
    tuned = {**BASE, "training.seed": 12, "training.steps": 1, "model.init": str(out)}
    y = tmp_path / "from-export"
    job_y = job_for(tuned)
    assert run_ranks(job_y, y, 1) == [0], logs(y)
    assert "model.init:" in logs(y)
    x = tmp_path / "from-checkpoint"
    assert run_ranks(job_for({**tuned, "model.init": str(orig / "checkpoints" / "step-3")}), x, 1) == [0], logs(x)
    want = first_step_loss_of(str(orig), job_y)
    got_y, got_x = losses(y)[1], losses(x)[1]
    assert abs(got_y - want) <= 1e-6 * want, (got_y, want)
    assert abs(got_x - want) <= 1e-6 * want, (got_x, want)
    fresh = tmp_path / "fresh"
    assert run_ranks(job_for({**tuned, "model.init": None}), fresh, 1) == [0], logs(fresh)
    assert got_y < losses(fresh)[1] - 0.1  # it really started from the trained weights
    os.environ.pop("SEQTRAIN_TEST_NOTHING", None)
