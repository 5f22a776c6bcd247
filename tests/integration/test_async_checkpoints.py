"""Async checkpoints with real rank processes (gloo on CPU): the state is staged in host memory and written by a
background thread while training goes on; a rank killed during that write leaves the previous checkpoint as the
latest, and the next run resumes from it with the uninterrupted run's losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_util import job_for, logs, losses, metrics, run_ranks

from seqtrain.checkpoint import list_checkpoints
from seqtrain.parallel.consolidate import consolidate

pytestmark = pytest.mark.slow

SETS = {"replicas": 2, "training.steps": 6, "checkpoint.intervalSteps": 2, "checkpoint.keep": 3}


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wd = tmp_path_factory.mktemp("sync") / "run"
    assert run_ranks(job_for({**SETS, "checkpoint.asyncSave": False}), wd, 2) == [0, 0], logs(wd)
    return wd


def test_async_saves_hold_exactly_the_synchronous_state_and_each_saving_step_says_what_it_blocked(
        sync_run: Path, tmp_path: Path) -> None:
    wd = tmp_path / "async"
    assert run_ranks(job_for(SETS), wd, 2) == [0, 0], logs(wd)
    assert losses(wd) == losses(sync_run)
    for step in (2, 4, 6):  # written while the next steps trained: the staged copy, not later weights
        got, want = consolidate(str(wd / "checkpoints" / f"step-{step}")), \
            consolidate(str(sync_run / "checkpoints" / f"step-{step}"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), step
    meta = json.loads((wd / "checkpoints" / "step-6" / "meta.json").read_text())
    assert meta["format"] == "dcp-1" and "state" in meta["files"]
    blocked = {m["step"]: m["ckpt_block_s"] for m in metrics(wd) if "ckpt_block_s" in m}
    assert sorted(blocked) == [2, 4, 6] and all(s >= 0 for s in blocked.values())


def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint_the_latest(
        sync_run: Path, tmp_path: Path) -> None:
    wd = tmp_path / "crash"
    # rank 0 SIGKILLs itself in its background writer, after step 4's state was written and before publishing
    env = {"SEQTRAIN_FAULT_IN_SAVE": "crash", "SEQTRAIN_FAULT_SAVE_STEP": "4"}
    codes = run_ranks(job_for(SETS), wd, 2, env=env)
    assert codes[0] == -9 and "fault injection in checkpoint save of step 4: crash" in logs(wd), (codes, logs(wd))
    assert [c.step for c in list_checkpoints(str(wd / "checkpoints"))] == [2]
    assert (wd / "checkpoints" / ".tmp-step-4").is_dir()  # the cut write, never read
    for log in wd.glob("rank*.log"):
        log.unlink()
    assert run_ranks(job_for(SETS), wd, 2) == [0, 0], logs(wd)
    assert "resumed from step 2" in logs(wd)
    assert losses(wd) == losses(sync_run)  # steps 3-6 recomputed, as if nothing happened
    assert [c.step for c in list_checkpoints(str(wd / "checkpoints"))] == [2, 4, 6]
