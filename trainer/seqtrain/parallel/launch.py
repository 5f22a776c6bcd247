"""Start a job's rank processes on this machine (the pod entrypoint, one process per rank) and wait for them.

A minimal launcher for the layout benchmark and the parity tests; `seqtrain run` (the local backend) is the
user-facing way, with restarts and status. Every wait has a deadline.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from seqtrain.spec import RuntimeConfig, SeqTrainJob, write_trainer_config

_SRC = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[3] / "operator")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(job: SeqTrainJob, workdir: Path, world: int, timeout: float = 300.0,
              env: dict[str, str] | None = None) -> list[int]:
    """Run `world` ranks of `job` with `workdir` as run folder; return their exit codes (-9: killed at the
    deadline). Output goes to workdir/rank<N>.log."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "trainer-config.json"
    write_trainer_config(str(cfg), job, RuntimeConfig(workdir=str(workdir), checkpoint_dir=str(workdir / "checkpoints")))
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env or {}))
        e.setdefault("OMP_NUM_THREADS", "1")
        e.setdefault("DS_ACCELERATOR", "cpu")
        e["PYTHONPATH"] = os.pathsep.join([*_SRC, e.get("PYTHONPATH", "")])
        log = open(workdir / f"rank{rank}.log", "ab")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, "-m", "seqtrain.train.entry", "--config", str(cfg)],
                                       env=e, stdout=log, stderr=subprocess.STDOUT, cwd=str(workdir)), log))
    deadline = time.monotonic() + timeout
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            p.wait(timeout=30)
            codes.append(-9)
        log.close()
    return codes
