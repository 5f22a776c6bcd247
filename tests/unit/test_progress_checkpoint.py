"""status.progress.lastCheckpoint follows the saves that are published between step ends (an async save finishing
while the gang is held, hung or evaluating), not only at the next step end (seqtrain.obs.callbacks.ProgressPublisher).
Seen in a full run: a gang held at step 8 showed workAtRisk.checkpointStep 3 and lastCheckpoint null for good."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from seqtrain.checkpoint.publish import Publisher, publish
from seqtrain.obs import callbacks
from seqtrain.obs.callbacks import ProgressPublisher

DEADLINE_S = 60.0  # a deadline for a thread polling every few milliseconds here, not a measurement


class Trainer(SimpleNamespace):
    """What ProgressPublisher reads of the trainer: a save is due at the steps in `due`."""

    def __init__(self, tmp: Path, due: set[int]) -> None:
        super().__init__(runtime=SimpleNamespace(workdir=str(tmp), checkpoint_dir=str(tmp / "checkpoints")),
                         total_steps=20, checkpoint_seconds=0.0, step=0, due=due)

    def checkpoint_due(self) -> bool:
        return self.step in self.due

    def checkpoint_report(self) -> dict[str, Any]:
        return {}


def step_end(pub: ProgressPublisher, trainer: Trainer, step: int) -> None:
    trainer.step = step
    pub.on_step_end(trainer, step, {"loss": 2.0})  # type: ignore[arg-type]


def save(trainer: Trainer, step: int) -> None:
    """What the background writer does: write into a temporary folder, then publish it as step-N."""
    tmp = os.path.join(trainer.runtime.checkpoint_dir, f".tmp-step-{step}")
    os.makedirs(tmp)
    Path(tmp, "model.bin").write_bytes(b"weights")
    publish(Publisher(trainer.runtime.checkpoint_dir, keep=3, world=1), step, tmp, None)


def last_checkpoint(pub: ProgressPublisher) -> int | None:
    ck = json.loads(pub.reporter.document()).get("lastCheckpoint")
    return ck["step"] if ck else None


def wait_for(probe: Any) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not probe():
        assert time.monotonic() < deadline, "not reported before the deadline"
        time.sleep(0.01)


@pytest.fixture
def pub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ProgressPublisher:
    monkeypatch.setattr(callbacks, "WATCH_INTERVAL_S", 0.01)
    monkeypatch.delenv("SEQTRAIN_PROGRESS_PUSH_URL", raising=False)
    return ProgressPublisher(Trainer(tmp_path, set()), None)  # type: ignore[arg-type]


def test_a_save_published_while_no_step_ends_is_reported(pub: ProgressPublisher, tmp_path: Path) -> None:
    trainer = Trainer(tmp_path, due={3})
    step_end(pub, trainer, 3)  # the loop saves step 3 after this; then the gang holds: no step ends again
    assert last_checkpoint(pub) is None
    save(trainer, 3)
    wait_for(lambda: last_checkpoint(pub) == 3)
    on_disk = json.loads((tmp_path / "progress.json").read_text())
    assert on_disk["lastCheckpoint"]["step"] == 3 and on_disk["step"] == 3
    assert pub._watcher is not None
    pub._watcher.join(DEADLINE_S)
    assert not pub._watcher.is_alive()  # its one report made, it ends


def test_a_save_published_before_the_next_step_end_is_reported_once_and_in_order(pub: ProgressPublisher,
                                                                                 tmp_path: Path) -> None:
    trainer = Trainer(tmp_path, due={3, 6})
    step_end(pub, trainer, 3)
    save(trainer, 3)
    step_end(pub, trainer, 4)  # reported here or by the watcher; either way the step is taken once
    wait_for(lambda: last_checkpoint(pub) == 3)
    step_end(pub, trainer, 5)
    step_end(pub, trainer, 6)
    save(trainer, 6)
    wait_for(lambda: last_checkpoint(pub) == 6)
    step_end(pub, trainer, 7)
    assert last_checkpoint(pub) == 6  # never back to an older save


def test_the_end_of_training_stops_a_watcher_whose_save_never_came(pub: ProgressPublisher, tmp_path: Path) -> None:
    trainer = Trainer(tmp_path, due={3})
    step_end(pub, trainer, 3)  # the save fails (full disk): nothing is ever published
    watcher = pub._watcher
    assert watcher is not None and watcher.is_alive()
    pub.on_train_end(trainer, "error")  # type: ignore[arg-type]
    assert not watcher.is_alive()
    assert last_checkpoint(pub) is None
