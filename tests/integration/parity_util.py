"""Run a job as real rank processes (`python -m seqtrain.train.entry --config`, the pod entrypoint) and read
back its metrics. Shared by the loss-parity tests and the layout benchmark."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from seqtrain.spec import RuntimeConfig, apply_overrides, parse_job, resolve, write_trainer_config

ROOT = Path(__file__).resolve().parents[2]

TINY_GPT = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: parity}
spec:
  model: {arch: gpt, dim: 64, layers: 4, heads: 4, ffnDim: 128}
  data: {seqLen: 32, shuffle: true}
  training:
    steps: 4
    globalBatchSize: 8
    microBatchSize: 4
    seed: 7
    optimizer: {lr: 0.003}
    schedule: {name: cosine, warmupSteps: 1}
    gradClip: 1.0
  checkpoint: {intervalSteps: 1000, keep: 2}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_for(sets: dict[str, Any], base: str = TINY_GPT):
    doc = apply_overrides(yaml.safe_load(base), [f"{k}={json.dumps(v)}" for k, v in sets.items()])
    return resolve(parse_job(doc))


def run_ranks(job, workdir: Path, world: int, timeout: float = 240.0, env: dict | None = None) -> list[int]:
    """Start `world` rank processes for `job` in `workdir`; wait (with a deadline); return their exit codes."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "trainer-config.json"
    write_trainer_config(str(cfg), job, RuntimeConfig(workdir=str(workdir), checkpoint_dir=str(workdir / "checkpoints")))
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **(env or {}))
        e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "trainer"), str(ROOT / "operator"), e.get("PYTHONPATH", "")])
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
            codes.append(-9)
        log.close()
    return codes


def losses(workdir: Path) -> dict[int, float]:
    out = {}
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            m = json.loads(line)
            out[int(m["step"])] = float(m["loss"])
    return out


def metrics(workdir: Path) -> list[dict]:
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def logs(workdir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(workdir.glob("rank*.log")))
