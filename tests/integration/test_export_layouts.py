"""`seqtrain export` from real checkpoints: one process and two tensor-parallel ranks (both the DCP `state/`; the
tensor-parallel slices are recorded there as parts of the full tensors); transformers gives the trained model's
logits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from parity_util import job_for, logs, run_ranks

from seqtrain.export.weights import load_source
from seqtrain.models import build_model
from seqtrain_operator.cli import main as cli_main

pytestmark = pytest.mark.slow
os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

LAYOUTS = {
    "single": ({}, 1),
    "tp2": ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2}, 2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_export_from_a_trained_run_matches_transformers(name: str, tmp_path: Path) -> None:
    sets, world = LAYOUTS[name]
    job = job_for({"training.steps": 2, "model.kvHeads": 2, "model.tieEmbeddings": False, **sets})
    wd = tmp_path / name
    assert run_ranks(job, wd, world) == [0] * world, logs(wd)
    out = tmp_path / "hf"
    assert cli_main(["export", str(wd), "--format", "hf", "--out", str(out)]) == 0
    # reference: the consolidated checkpoint in seqtrain's own model
    w = load_source(str(wd / "checkpoints" / "step-2"))
    model = build_model(w.spec).eval()
    model.load_state_dict(w.state, strict=True)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens) @ model.output_weight.T
        got = hf_model(tokens).logits
    assert (got - want).abs().max().item() < 1e-4
