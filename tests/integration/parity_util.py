"""Run a job as real rank processes (`python -m seqtrain.train.entry --config`, the pod entrypoint) and read
back its metrics. Shared by the loss-parity tests and the layout benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from seqtrain.parallel.launch import run_ranks  # noqa: F401 - re-exported for the tests
from seqtrain.spec import apply_overrides, parse_job, resolve

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


def job_for(sets: dict[str, Any], base: str = TINY_GPT):
    doc = apply_overrides(yaml.safe_load(base), [f"{k}={json.dumps(v)}" for k, v in sets.items()])
    return resolve(parse_job(doc))


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
    """Every rank's whole log: tests search it for lines written at start-up (a tail cut them off once the step
    lines grew; pytest shortens what a failed assert prints anyway)."""
    return "\n".join(p.read_text(errors="replace") for p in sorted(workdir.glob("rank*.log")))
