"""A checkpoint save slower than the collective timeout does not end the gang: the save's barriers wait on storage
with their own deadline (SEQTRAIN_CHECKPOINT_TIMEOUT_SECONDS), not on optimization.commTimeoutSeconds."""

from __future__ import annotations

import pytest
from parity_util import job_for, logs, run_ranks

from seqtrain.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow


def test_a_save_slower_than_the_collective_timeout_completes(tmp_path) -> None:
    job = job_for({"replicas": 2, "training.steps": 3, "checkpoint.intervalSteps": 2,
                   "optimization.commTimeoutSeconds": 10})
    # rank 0 takes 25 s (2.5 x the collective timeout) to publish step 2, while rank 1 waits at the save's barrier
    env = {"OMP_NUM_THREADS": "1", "SEQTRAIN_FAULT_IN_SAVE": "sleep:25", "SEQTRAIN_FAULT_SAVE_STEP": "2"}
    assert run_ranks(job, tmp_path, 2, timeout=600, env=env) == [0, 0], logs(tmp_path)
    assert [c.step for c in list_checkpoints(str(tmp_path / "checkpoints"))] == [2, 3]
