"""A peer that stops answering mid-training: the waiting rank reports what it waited for and exits 4."""

from __future__ import annotations

import os
import signal
import time

import pytest
from parity_util import job_for

from seqtrain.parallel.launch import start_ranks
from seqtrain.spec import RuntimeConfig, write_trainer_config

pytestmark = pytest.mark.slow


def test_stopped_peer_makes_the_other_rank_exit_4(tmp_path) -> None:
    # steps it cannot finish: rank 1 is stopped mid-run however fast the machine is
    job = job_for({"replicas": 2, "training.steps": 100000, "optimization.commTimeoutSeconds": 10})
    cfg = tmp_path / "cfg.json"
    write_trainer_config(str(cfg), job, RuntimeConfig(workdir=str(tmp_path), checkpoint_dir=str(tmp_path / "ck")))
    procs = start_ranks(cfg, tmp_path, 2, {"OMP_NUM_THREADS": "1"})  # identities as the one launcher gives them
    log0 = tmp_path / "rank0.log"
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline, "training never reached step 2"
            assert procs[0].poll() is None, log0.read_text()
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGSTOP)  # rank 1 hangs: alive, sockets open, never answers
        procs[0].wait(timeout=90)
        out = log0.read_text()
        assert procs[0].returncode == 4, out
        # gloo's timeout fires first and names the labelled wait; the watchdog would follow a little later
        assert "rank 0: collective communication timed out while waiting for step" in out or \
            "rank 0: collective timeout" in out, out
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
