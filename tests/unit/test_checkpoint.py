"""Checkpoint publishing, discovery and pruning; in-process trainer save/resume (single rank)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from seqtrain.checkpoint import CheckpointManager, latest_checkpoint, latest_step, list_checkpoints
from seqtrain.runtime.dist import DistContext
from seqtrain.spec import RuntimeConfig, load_job, resolve


def writer(names: list[str], fail: bool = False):  # noqa: ANN201
    def write(directory: str) -> list[str]:
        for n in names:
            Path(directory, n).write_text(n)
        if fail:
            raise RuntimeError("disk full")
        return names
    return write


def test_save_publishes_complete_folder_with_meta(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext())
    info = mgr.save(5, writer(["a.pt", "b.pt"]), {"loss": 1.5})
    assert info.step == 5 and info.path == str(tmp_path / "step-5")
    meta = json.loads((tmp_path / "step-5" / "meta.json").read_text())
    assert meta["step"] == 5 and meta["files"] == ["a.pt", "b.pt"] and meta["loss"] == 1.5 and meta["world"] == 1
    assert sorted(os.listdir(tmp_path)) == ["step-5"]
    assert latest_step(str(tmp_path)) == 5


def test_incomplete_folders_are_never_resumed_from(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=5, ctx=DistContext())
    mgr.save(2, writer(["x"]))
    (tmp_path / ".tmp-step-9").mkdir()  # a save cut by a crash
    (tmp_path / "step-7").mkdir()  # no meta.json
    (tmp_path / "step-8").mkdir()
    (tmp_path / "step-8" / "meta.json").write_text('{"step": 8, "files": ["gone.pt"]}')  # a listed file is missing
    (tmp_path / "step-6").mkdir()
    (tmp_path / "step-6" / "meta.json").write_text('{"step": 5, "files": []}')  # names another step
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / "meta.json").write_text('{"step": 4, "fi')  # cut mid-write
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2]
    assert latest_checkpoint(str(tmp_path)).step == 2
    assert latest_step(str(tmp_path / "missing")) == 0


def test_a_file_changed_since_publishing_is_set_aside_with_the_reason(tmp_path: Path) -> None:
    from seqtrain.checkpoint.discovery import quarantined

    mgr = CheckpointManager(str(tmp_path), keep=5, ctx=DistContext())
    mgr.save(2, writer(["x.pt"]))
    mgr.save(4, writer(["x.pt"]))
    assert json.loads((tmp_path / "step-4" / "meta.json").read_text())["sizes"] == {"x.pt": 4}
    (tmp_path / "step-4" / "x.pt").write_text("x")  # truncated
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2]  # the controller never reports it
    assert mgr.latest().step == 2  # the trainer resumes from the previous one ...
    assert not (tmp_path / "step-4").exists()
    (step, reason), = quarantined(str(tmp_path))  # ... and the reason is kept for the event
    assert step == 4 and reason.endswith("x.pt: 1 bytes, but 4 when it was saved (truncated or replaced)")


def test_safe_load_refuses_a_pickle_with_code_and_names_the_file(tmp_path: Path) -> None:
    import pickle
    import uuid

    import torch

    from seqtrain.checkpoint.safe_load import UnusableCheckpoint, load_plain

    marker = Path(f"/tmp/PWNED-{uuid.uuid4().hex}")

    class Payload:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "trainer.pt"
    torch.save({"step": 1, "x": Payload()}, bad, pickle_module=pickle)
    with pytest.raises(UnusableCheckpoint, match=r"trainer.pt: refused"):
        load_plain(str(bad))
    assert not marker.exists()
    cut = tmp_path / "cut.pt"
    torch.save({"t": torch.arange(1000)}, cut)
    cut.write_bytes(cut.read_bytes()[:300])
    with pytest.raises(UnusableCheckpoint, match=r"cut.pt: unreadable"):
        load_plain(str(cut))


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    import random

    import numpy as np
    import torch

    from seqtrain.checkpoint.safe_load import load_plain
    from seqtrain.train.loop import rng_state, set_rng_state

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_state(load_plain(str(tmp_path / "rng.pt")))
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want


def test_failed_write_publishes_nothing_and_next_save_cleans_up(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=2, ctx=DistContext())
    mgr.save(1, writer(["a"]))
    with pytest.raises(RuntimeError, match="disk full"):
        mgr.save(2, writer(["a"], fail=True))
    assert latest_step(str(tmp_path)) == 1 and (tmp_path / ".tmp-step-2").exists()
    mgr.save(2, writer(["a"]))
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2"]


def test_prune_keeps_the_latest_and_a_redone_step_replaces_its_folder(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=2, ctx=DistContext())
    for step in (1, 2, 3, 4):
        mgr.save(step, writer([f"s{step}"]))
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [3, 4]
    mgr.save(4, writer(["again"]))
    assert (tmp_path / "step-4" / "again").exists() and not (tmp_path / "step-4" / "s4").exists()
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]


@pytest.mark.slow
def test_checkpoint_discovery_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, seqtrain.checkpoint; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- in-process trainer (world 1, no process group) ---------------------------------------------------------

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: unit}
spec:
  model: {arch: gpt, preset: tiny, dim: 32, heads: 2, ffnDim: 64}
  data: {seqLen: 16}
  training: {steps: 6, globalBatchSize: 4, microBatchSize: 2, schedule: {warmupSteps: 1}}
  checkpoint: {intervalSteps: 2, keep: 2}
"""


def make_trainer(workdir: Path, steps: int = 6):  # noqa: ANN201
    from seqtrain.train.loop import Trainer

    # a run resumed with more steps than its checkpoint was made for recomputes the schedule (allowed here: these
    # tests are about what is resumed, tests/unit/test_schedule_resume.py about the schedule)
    job = resolve(load_job(JOB, [f"training.steps={steps}", "training.allowScheduleChange=true"]))
    runtime = RuntimeConfig(workdir=str(workdir), checkpoint_dir=str(workdir / "ckpt"))
    trainer = Trainer(job, runtime, DistContext())
    trainer.setup()
    return trainer


def losses(workdir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_trainer_terminated_mid_run_resumes_bit_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = make_trainer(tmp_path / "ref")
    assert ref.run() == "completed"
    assert [c.step for c in list_checkpoints(str(tmp_path / "ref" / "ckpt"))] == [4, 6]

    monkeypatch.setenv("SEQTRAIN_FAULT_TERM_AT_STEP", "3")
    first = make_trainer(tmp_path / "run")
    assert first.run() == "terminated" and first.step == 3
    assert latest_step(str(tmp_path / "run" / "ckpt")) == 3  # saved off-interval on termination
    monkeypatch.delenv("SEQTRAIN_FAULT_TERM_AT_STEP")
    second = make_trainer(tmp_path / "run")
    assert second.step == 3 and second.resumed_from is not None and second.data.cursor == 3 * 4
    assert second.run() == "completed"
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    for (name, a), b in zip(ref.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert a.equal(b), name


def test_resume_truncates_metrics_written_after_the_checkpoint(tmp_path: Path) -> None:
    t = make_trainer(tmp_path)
    t.run()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 1.0}\n{"step": 8, "lo')  # written by a gang that died before saving
    make_trainer(tmp_path, steps=8)  # resumes from step 6
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 7))


def test_a_step_folder_without_the_dcp_tree_is_unusable_in_one_line(tmp_path: Path) -> None:
    """Only the DCP format is resumed: a folder without `state/` (an `engine.pt` beside it or not) is set aside."""
    from seqtrain.checkpoint.safe_load import UnusableCheckpoint

    t = make_trainer(tmp_path / "run")
    old = tmp_path / "step-3"
    old.mkdir()
    (old / "engine.pt").write_bytes(b"")
    with pytest.raises(UnusableCheckpoint, match=r"no state/ folder") as err:
        t.engine.load(str(old))
    assert "\n" not in str(err.value)
    t.prefetcher.close()
