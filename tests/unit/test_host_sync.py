"""The host off the critical path: the next step's batches come from a background thread without changing the
data position a checkpoint records, and an engine step reads device values back to the host once."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from seqtrain.data import build_train_data
from seqtrain.data.prefetch import Prefetcher
from seqtrain.runtime.dist import DistContext
from seqtrain.spec import RuntimeConfig, load_job, resolve
from seqtrain.train.loop import Trainer

YAML = textwrap.dedent("""
    apiVersion: seqtrain.dev/v1alpha1
    kind: SeqTrainJob
    metadata: {name: sync}
    spec:
      model: {arch: gpt, preset: tiny}
      data: {seqLen: 32, packing: PACKING}
      training: {steps: 3, globalBatchSize: 4, microBatchSize: 2, seed: 5, gradClip: 1.0}
      checkpoint: {intervalSteps: 1000}
    """)


def job(packing: bool = False):
    return resolve(load_job(YAML.replace("PACKING", str(packing).lower())))


@pytest.mark.parametrize("packing", [False, True], ids=["windows", "packed"])
def test_prefetching_yields_the_same_steps_and_checkpoints_the_unconsumed_position(packing: bool) -> None:
    j = job(packing)
    plain = build_train_data(j, 0, 1)
    pre = Prefetcher(build_train_data(j, 0, 1), pin_memory=False)
    try:
        for _ in range(3):
            want, got = plain.next_step(), pre.next_step()
            assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
                       for a, b in zip(want, got, strict=True))
            # the worker already built the next step, but the position saved is the one after this step
            assert pre.state_dict() == plain.state_dict()
        resumed = build_train_data(j, 0, 1)
        resumed.load_state_dict(pre.state_dict())
        assert torch.equal(resumed.next_step()[0].tokens, plain.next_step()[0].tokens)
        pre.reset()  # what a checkpoint load does first: the prefetched step is dropped
        pre.data.load_state_dict(resumed.state_dict())
        assert torch.equal(pre.next_step()[0].tokens, resumed.next_step()[0].tokens)
    finally:
        pre.close()


def test_a_native_engine_step_reads_the_device_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts tensor -> Python conversions made by seqtrain code during engine.step (fp32, clipping on)."""
    trainer = Trainer(job(), RuntimeConfig(workdir=str(tmp_path), checkpoint_dir=str(tmp_path / "ck")), DistContext())
    trainer.setup()
    batches = trainer.prefetcher.next_step()
    reads: list[str] = []
    pkg = str(Path(__import__("seqtrain").__file__).parent)

    def counting(name: str):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(pkg):
                reads.append(f"{name} at {Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
            return real(self, *a, **k)
        return wrapper

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    stats = trainer.engine.step(batches)
    monkeypatch.undo()
    trainer.prefetcher.close()
    assert len(reads) == 1 and reads[0].startswith("tolist at base.py"), reads
    assert stats.target_tokens > 0 and stats.grad_norm > 0 and not stats.skipped


def test_a_sigterm_handled_right_after_the_step_all_reduce_is_not_lost(tmp_path: Path) -> None:
    """A Python signal handler runs at the first bytecode after the blocking all-reduce returns, i.e. before its
    result is stored: the agreed flag must not overwrite the signal (every rank would lose it and train on)."""
    trainer = Trainer(job(), RuntimeConfig(workdir=str(tmp_path), checkpoint_dir=str(tmp_path / "ck")), DistContext())

    def all_reduce_then_signal(tensor: torch.Tensor, op: str = "sum") -> None:
        trainer.terminate_signal = True  # what the SIGTERM handler does, after the collective took the old value

    trainer.ctx.all_reduce = all_reduce_then_signal  # type: ignore[method-assign]
    trainer.agree()
    assert not trainer.terminate_requested  # the signal came after this step's agreement ...
    trainer.agree()
    assert trainer.terminate_requested  # ... and the next one carries it to every rank
