"""`seqtrain bench layouts`: time per step and loss agreement per distributed layout, on this machine.

Each layout trains the same small job (same seed, same global batch) as real rank processes
(`seqtrain.parallel.launch`), fp32. Reported per layout: processes, median step time over steps 2..N (step 1
builds pipelines and warms allocators), tokens/s, and the largest relative difference of a step's loss from
the single-process run (the parity figure of docs/benchmarks.md).

    seqtrain bench layouts --out layouts.json
    seqtrain bench layouts --layouts single,dp2,tp2 --steps 10 --dim 128 --layers 4
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from seqtrain.parallel.launch import run_ranks
from seqtrain.spec import apply_overrides, parse_job, resolve

_NATIVE3 = {"optimization.engine": "native", "optimization.zero.stage": 3}
_SP = {"optimization.sequenceParallel": True}
# name -> (overrides, processes)
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "single": ({}, 1),
    "dp2": ({"replicas": 2}, 2),
    "zero1-dp2": ({"replicas": 2, "optimization.zero.stage": 1}, 2),
    "zero2-dp2": ({"replicas": 2, "optimization.zero.stage": 2}, 2),
    "zero3-dp2": ({"replicas": 2, "optimization.zero.stage": 3}, 2),
    "zero3-offload-dp2": ({"replicas": 2, "optimization.zero.stage": 3, "optimization.zero.offload": "cpu"}, 2),
    "fsdp2-dp2": ({"replicas": 2, **_NATIVE3}, 2),
    "tp2": ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2}, 2),
    "pp2-gpipe": ({"replicas": 2, "optimization.pipelineParallel": 2, "optimization.pipelineSchedule": "gpipe"}, 2),
    "pp2-1f1b": ({"replicas": 2, "optimization.pipelineParallel": 2}, 2),
    "pp2-interleaved": ({"replicas": 2, "optimization.pipelineParallel": 2,
                         "optimization.pipelineSchedule": "interleaved"}, 2),
    "dp2xtp2": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2}, 4),
    "dp2xpp2": ({"replicas": 4, "optimization.pipelineParallel": 2}, 4),
    "tp2xpp2": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
                 "optimization.pipelineParallel": 2}, 4),
    "fsdp2-dp2xtp2": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
                       **_NATIVE3}, 4),
    # sequence parallel (optimization.sequenceParallel) on each tensor-parallel layout
    "tp2-sp": ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2, **_SP}, 2),
    "dp2xtp2-sp": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2, **_SP}, 4),
    "tp2xpp2-sp": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
                    "optimization.pipelineParallel": 2, **_SP}, 4),
    "fsdp2-dp2xtp2-sp": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
                          **_NATIVE3, **_SP}, 4),
}


def base_job(dim: int, layers: int, heads: int, seq_len: int, batch: int, micro: int, steps: int) -> dict:
    return yaml.safe_load(f"""
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {{name: bench-layouts}}
spec:
  model: {{arch: gpt, dim: {dim}, layers: {layers}, heads: {heads}}}
  data: {{seqLen: {seq_len}}}
  training: {{steps: {steps}, globalBatchSize: {batch}, microBatchSize: {micro}, seed: 7,
             optimizer: {{lr: 0.003}}, schedule: {{name: cosine, warmupSteps: 1}}}}
  checkpoint: {{intervalSteps: 100000}}
""")


def _read(workdir: Path) -> list[dict]:
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqtrain bench layouts", description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of: " + ", ".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--micro", type=int, default=4, help="micro-batch (sequences)")
    p.add_argument("--workdir", help="keep run folders here (default: a temporary folder)")
    p.add_argument("--out", help="write the JSON here (default: stdout)")
    args = p.parse_args(list(argv) if argv is not None else None)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    if "single" not in names:
        names.insert(0, "single")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="seqtrain-bench-layouts-"))
    base = base_job(args.dim, args.layers, args.heads, args.seq_len, args.batch, args.micro, args.steps)
    results, ref = [], None
    for name in names:
        sets, world = LAYOUTS[name]
        doc = apply_overrides(json.loads(json.dumps(base)), [f"{k}={json.dumps(v)}" for k, v in sets.items()])
        job = resolve(parse_job(doc))
        wd = root / name
        t0 = time.perf_counter()
        codes = run_ranks(job, wd, world, timeout=600)
        wall = time.perf_counter() - t0
        row: dict[str, Any] = {"layout": name, "processes": world, "wall_s": round(wall, 1), "exit_codes": codes}
        if codes == [0] * world:
            ms = _read(wd)
            times = [m["step_time_s"] for m in ms[1:]] or [ms[0]["step_time_s"]]
            row["step_time_s_median"] = statistics.median(times)
            row["tokens_per_s_median"] = statistics.median(m["tokens_per_s"] for m in ms[1:] or ms)
            row["losses"] = [m["loss"] for m in ms]
            if name == "single":
                ref = row["losses"]
            if ref:
                row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], ref, strict=True))
        results.append(row)
        print(f"{name:>18}: {row.get('step_time_s_median', float('nan')):.3f} s/step, "
              f"max rel loss diff {row.get('max_rel_loss_diff', float('nan')):.1e}", file=sys.stderr, flush=True)
    out = {
        "benchmark": "layouts",
        "date": dt.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": "seqtrain bench layouts " + " ".join(argv if argv is not None else sys.argv[1:]),
        "job": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "seq_len": args.seq_len,
                "global_batch": args.batch, "micro_batch": args.micro, "steps": args.steps, "precision": "fp32"},
        "results": results,
    }
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0 if all(r["exit_codes"] == [0] * r["processes"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
