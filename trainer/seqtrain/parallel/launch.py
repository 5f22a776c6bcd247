"""Start a whole job's rank processes on this machine without the controller, for the parity tests, the trainer's
rank tests and the layout benchmark (which need each rank's own exit code). Identity and rendezvous come from the one
launcher (`seqtrain.runtime.launch`: `rank_envs`, `free_port`), exactly as it gives them to a pod's ranks; `seqtrain
run` (the local backend, with restarts and status) runs the pod's command itself. Every wait has a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from seqtrain.parallel import forked
from seqtrain.runtime.launch import free_port, rank_envs
from seqtrain.spec import RuntimeConfig, SeqTrainJob, write_trainer_config

__all__ = ["free_port", "run_ranks", "start_ranks", "wait_ranks"]

_SRC = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[3] / "operator")]
# Identity a developer's shell (or a rank that runs a test) might hold: the launcher's rules decide it here.
_IDENTITY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "SEQTRAIN_REPLICA", "MASTER_ADDR",
             "MASTER_PORT")


def start_ranks(config: Path, workdir: Path, world: int,
                env: dict[str, str] | None = None) -> list[subprocess.Popen | forked.ForkedRank]:
    """Start `world` ranks of `seqtrain train --config config` (the whole job on this machine, rendezvous on a free
    loopback port); rank r's output goes to workdir/rank<r>.log. Forked from a server that imported torch once
    where SEQTRAIN_FORK_RANKS=1 (seqtrain.parallel.forked), else executed."""
    base = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in _IDENTITY}
    base.setdefault("OMP_NUM_THREADS", "1")
    base.setdefault("DS_ACCELERATOR", "cpu")
    base["PYTHONPATH"] = os.pathsep.join([*_SRC, base.get("PYTHONPATH", "")])
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    procs: list[subprocess.Popen | forked.ForkedRank] = []
    for extra in rank_envs(world, base):
        rank_env, log_path = {**base, **extra}, workdir / f"rank{extra['RANK']}.log"
        if forked.forkable(rank_env):
            procs.append(forked.start(config, workdir, rank_env, log_path))
            continue
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([sys.executable, "-m", forked.RANK_MODULE, "--config", str(config)],
                                          env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, cwd=str(workdir)))
    return procs


def wait_ranks(procs: list[subprocess.Popen | forked.ForkedRank], timeout: float) -> list[int]:
    """Each rank's return code (-9 for every rank still running at the deadline, which kills them all)."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.wait(timeout=30)
            codes.append(-9)
    return codes


def run_ranks(job: SeqTrainJob, workdir: Path, world: int, timeout: float = 300.0,
              env: dict[str, str] | None = None) -> list[int]:
    """Run `world` ranks of `job` with `workdir` as run folder; return their exit codes (-9: killed at the
    deadline). Output goes to workdir/rank<N>.log."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "trainer-config.json"
    write_trainer_config(str(cfg), job, RuntimeConfig(workdir=str(workdir), checkpoint_dir=str(workdir / "checkpoints")))
    return wait_ranks(start_ranks(cfg, workdir, world, env), timeout)
