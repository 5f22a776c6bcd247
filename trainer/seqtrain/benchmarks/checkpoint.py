"""`seqtrain bench checkpoint`: how long each checkpoint save holds training up, synchronous vs async.

One real trainer (the per-rank `Trainer`, one process, the native engine) trains a GPT preset and saves a
checkpoint after every step, once with `checkpoint.asyncSave: false` and once with `true`. Each saving step's
`ckpt_block_s` (what the save held the training thread up: all of it when synchronous; staging the state into host
memory plus waiting for the previous background write when async, that wait being `ckpt_wait_s`) comes from the
run's metrics.jsonl; when steps are much shorter than a write (a GPU) back-to-back saves mostly wait, so
`block_without_wait_s` is the figure of the save itself, and `--interval-steps` spaces the saves; `save_s` is the
whole last save (background included). The model must be big enough that writing it takes longer than staging it.

    seqtrain bench checkpoint --preset 125m --out benchmarks/results/checkpoint-cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import yaml

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: bench-checkpoint}
spec:
  model: {arch: gpt, preset: PRESET}
  data: {seqLen: 64}
  training: {steps: 4, globalBatchSize: 1, microBatchSize: 1, schedule: {warmupSteps: 1}}
  checkpoint: {intervalSteps: 1, keep: 1}
"""


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)


def run_mode(preset: str, async_save: bool, steps: int, seq_len: int, root: str, device: str = "cpu",
             precision: str = "fp32", interval: int = 1) -> dict[str, Any]:
    from seqtrain.checkpoint import latest_checkpoint
    from seqtrain.models import count_parameters
    from seqtrain.runtime.dist import DistContext
    from seqtrain.spec import RuntimeConfig, parse_job, resolve
    from seqtrain.train.loop import Trainer

    doc = yaml.safe_load(JOB.replace("PRESET", preset))
    doc["spec"]["training"]["steps"] = steps
    doc["spec"]["data"]["seqLen"] = seq_len
    doc["spec"]["checkpoint"]["asyncSave"] = async_save
    doc["spec"]["checkpoint"]["intervalSteps"] = interval
    doc["spec"]["optimization"] = {"precision": precision}
    workdir = os.path.join(root, "async" if async_save else "sync")
    shutil.rmtree(workdir, ignore_errors=True)
    runtime = RuntimeConfig(workdir=workdir, checkpoint_dir=os.path.join(workdir, "checkpoints"))
    # On a GPU the state to stage lives in device memory: the copy to the host is what an async save still blocks on.
    ctx = DistContext(device=torch.device(device))
    trainer = Trainer(resolve(parse_job(doc, check_features=False)), runtime, ctx)
    trainer.setup()
    started = time.monotonic()
    trainer.run()
    wall = time.monotonic() - started
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    saves = [m for m in rows if "ckpt_block_s" in m]
    blocks = [m["ckpt_block_s"] for m in saves]
    # what an async save blocks on besides the previous write: staging (the first save also allocates the
    # buffers the later ones reuse) and the small files
    staging = [round(m["ckpt_block_s"] - m.get("ckpt_wait_s", 0.0), 4) for m in saves]
    last = latest_checkpoint(runtime.checkpoint_dir)
    return {
        "async_save": async_save,
        "parameters": count_parameters(trainer.model),
        "checkpoint_bytes": _folder_bytes(last.path) if last else 0,
        "ckpt_block_s": blocks,
        "ckpt_block_s_median": round(statistics.median(blocks), 3) if blocks else None,
        "ckpt_wait_s": [m.get("ckpt_wait_s", 0.0) for m in saves],
        "block_without_wait_s": staging,
        "block_without_wait_s_median": round(statistics.median(staging), 3) if staging else None,
        "step_s_median": round(statistics.median(m["step_time_s"] for m in rows), 3),
        "last_save_s": round(trainer.checkpoints.last_save_seconds or 0.0, 3),
        "wall_s": round(wall, 2),
        "losses": [m["loss"] for m in rows],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqtrain bench checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="125m", help="GPT size preset (125m, 350m, ...)")
    p.add_argument("--steps", type=int, default=4, help="training steps per mode; a save after each")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--interval-steps", type=int, default=1, help="save every N steps (steps: a multiple of N)")
    p.add_argument("--workdir", default=None, help="where the two runs write (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout only)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model trains (auto: cuda when this process sees one)")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                   help="default: bf16 on cuda, fp32 on cpu")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    root = args.workdir or tempfile.mkdtemp(prefix="seqtrain-bench-ckpt-")
    result: dict[str, Any] = {
        "benchmark": "checkpoint",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu"),
        "precision": precision,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "command": "seqtrain bench checkpoint " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": args.preset,
        "modes": {},
    }
    try:
        for async_save in (False, True):
            result["modes"]["async" if async_save else "sync"] = run_mode(args.preset, async_save, args.steps,
                                                                          args.seq_len, root, device, precision,
                                                                          args.interval_steps)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    sync, asyn = result["modes"]["sync"], result["modes"]["async"]
    result["same_losses"] = sync["losses"] == asyn["losses"]
    if sync["ckpt_block_s_median"] and asyn["block_without_wait_s_median"]:
        result["block_reduction_without_wait_x"] = round(
            sync["ckpt_block_s_median"] / asyn["block_without_wait_s_median"], 1)
    if sync["ckpt_block_s_median"] and asyn["ckpt_block_s_median"]:
        result["block_reduction_x"] = round(sync["ckpt_block_s_median"] / asyn["ckpt_block_s_median"], 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
