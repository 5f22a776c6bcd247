"""`seqtrain bench checkpoint`: what saves hold training up, and what a background write (thread or process) costs.

How long each checkpoint save holds training up, synchronous vs async, and how much a background write slows the
steps it overlaps, written by a thread vs a process.

One real trainer (the per-rank `Trainer`, one process, the native engine) trains a GPT preset and saves a
checkpoint every `--interval-steps`, once per mode: `sync` (`checkpoint.asyncSave: false`), `async-thread` and
`async-process` (`true`, with SEQTRAIN_CHECKPOINT_WRITER=thread / process: where the background write runs). Each
step is `overlapping` when its compute interval (`time - step_time_s` to `time` in metrics.jsonl) meets a background
write's (handed over to the writer until written and published), else `clear`; `overlap_slowdown_x` is the ratio
of their median step times (the first step, warm-up, is left out of both). Each saving step's
`ckpt_block_s` (what the save held the training thread up: all of it when synchronous; staging the state into host
memory plus waiting for the previous background write when async, that wait being `ckpt_wait_s`) comes from the
run's metrics.jsonl; when steps are much shorter than a write (a GPU) back-to-back saves mostly wait, so
`block_without_wait_s` is the figure of the save itself, and `--interval-steps` spaces the saves; `save_s` is the
whole last save (background included). The model must be big enough that writing it takes longer than staging it.

    seqtrain bench checkpoint --preset 125m --steps 6 --interval-steps 2 --out benchmarks/results/checkpoint-cpu.json
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


MODES = ("sync", "async-thread", "async-process")


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def run_mode(preset: str, mode: str, steps: int, seq_len: int, root: str, device: str = "cpu",
             precision: str = "fp32", interval: int = 1) -> dict[str, Any]:
    from seqtrain.checkpoint import latest_checkpoint
    from seqtrain.checkpoint.writer import WRITER_ENV
    from seqtrain.models import count_parameters
    from seqtrain.runtime.dist import DistContext
    from seqtrain.spec import RuntimeConfig, parse_job, resolve
    from seqtrain.train.loop import Trainer

    doc = yaml.safe_load(JOB.replace("PRESET", preset))
    doc["spec"]["training"]["steps"] = steps
    doc["spec"]["data"]["seqLen"] = seq_len
    async_save = mode != "sync"
    doc["spec"]["checkpoint"]["asyncSave"] = async_save
    doc["spec"]["checkpoint"]["intervalSteps"] = interval
    doc["spec"]["optimization"] = {"precision": precision}
    workdir = os.path.join(root, mode)
    shutil.rmtree(workdir, ignore_errors=True)
    runtime = RuntimeConfig(workdir=workdir, checkpoint_dir=os.path.join(workdir, "checkpoints"))
    # On a GPU the state to stage lives in device memory: the copy to the host is what an async save still blocks on.
    ctx = DistContext(device=torch.device(device))
    before = os.environ.get(WRITER_ENV)
    os.environ[WRITER_ENV] = mode.removeprefix("async-") if async_save else "process"
    try:
        trainer = Trainer(resolve(parse_job(doc, check_features=False)), runtime, ctx)
        trainer.setup()  # builds the checkpoint manager, which reads WRITER_ENV
    finally:
        if before is None:
            del os.environ[WRITER_ENV]
        else:
            os.environ[WRITER_ENV] = before
    if async_save and not trainer.checkpoints.writing_in.startswith(mode.removeprefix("async-")):
        raise RuntimeError(f"mode {mode}: the manager writes in {trainer.checkpoints.writing_in}")
    # every background write's (start, end) in epoch seconds: a save first waits for the previous write, so right
    # after it returns the manager holds the previous write's window; the last one after run() (which closes)
    windows: list[tuple[float, float]] = []
    manager = trainer.checkpoints
    save = manager.save

    def save_and_note(*args: Any, **kwargs: Any) -> Any:
        out = save(*args, **kwargs)
        if manager.last_write_window and manager.last_write_window not in windows:
            windows.append(manager.last_write_window)
        return out

    manager.save = save_and_note  # type: ignore[method-assign]
    started, started_wall = time.monotonic(), time.time()
    trainer.run()
    wall = time.monotonic() - started
    if manager.last_write_window and manager.last_write_window not in windows:
        windows.append(manager.last_write_window)
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]

    def overlaps(m: dict[str, Any]) -> bool:
        begin, end = m["time"] - m["step_time_s"], m["time"]
        return any(begin < w_end and w_start < end for w_start, w_end in windows)

    timed = rows[1:]  # the first step warms up (allocations, autotuning): in neither group
    overlapping = [m["step_time_s"] for m in timed if overlaps(m)]
    clear = [m["step_time_s"] for m in timed if not overlaps(m)]
    saves = [m for m in rows if "ckpt_block_s" in m]
    blocks = [m["ckpt_block_s"] for m in saves]
    # what an async save blocks on besides the previous write: staging (the first save also allocates the
    # buffers the later ones reuse) and the small files
    staging = [round(m["ckpt_block_s"] - m.get("ckpt_wait_s", 0.0), 4) for m in saves]
    last = latest_checkpoint(runtime.checkpoint_dir)
    out = {
        "async_save": async_save,
        "writer": manager.writing_in if async_save else None,
        "parameters": count_parameters(trainer.model),
        "checkpoint_bytes": _folder_bytes(last.path) if last else 0,
        "ckpt_block_s": blocks,
        "ckpt_block_s_median": round(statistics.median(blocks), 3) if blocks else None,
        "ckpt_wait_s": [m.get("ckpt_wait_s", 0.0) for m in saves],
        "block_without_wait_s": staging,
        "block_without_wait_s_median": round(statistics.median(staging), 3) if staging else None,
        "step_s_median": round(statistics.median(m["step_time_s"] for m in rows), 3),
        "step_s": [round(m["step_time_s"], 4) for m in rows],
        "write_windows_s": [[round(a - started_wall, 3), round(b - started_wall, 3)] for a, b in windows],
        "overlapping_steps": [m["step"] for m in timed if overlaps(m)],
        "step_s_overlapping_write_median": _median(overlapping),
        "step_s_clear_median": _median(clear),
        "last_save_s": round(manager.last_save_seconds or 0.0, 3),
        "wall_s": round(wall, 2),
        "losses": [m["loss"] for m in rows],
    }
    if out["step_s_overlapping_write_median"] and out["step_s_clear_median"]:
        out["overlap_slowdown_x"] = round(out["step_s_overlapping_write_median"] / out["step_s_clear_median"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqtrain bench checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="125m", help="GPT size preset (125m, 350m, ...)")
    p.add_argument("--steps", type=int, default=4, help="training steps per mode")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--interval-steps", type=int, default=1, help="save every N steps (steps: a multiple of N)")
    p.add_argument("--workdir", default=None, help="where the runs write (default: a temporary folder)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout only)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model trains (auto: cuda when this process sees one)")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                   help="default: bf16 on cuda, fp32 on cpu")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes: each of {', '.join(MODES)}")
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
        # the 1-minute load average before and after: on a shared machine, what else ran meanwhile
        "load_average": [round(os.getloadavg()[0], 2)],
        "modes": {},
    }
    try:
        for mode in modes:
            result["modes"][mode] = run_mode(args.preset, mode, args.steps, args.seq_len, root, device, precision,
                                             args.interval_steps)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    result["load_average"].append(round(os.getloadavg()[0], 2))
    runs = result["modes"]
    result["same_losses"] = len({json.dumps(r["losses"]) for r in runs.values()}) == 1
    sync = runs.get("sync")
    for mode, run in runs.items():
        if mode == "sync" or sync is None:
            continue
        tag = mode.removeprefix("async-")
        if sync["ckpt_block_s_median"] and run["block_without_wait_s_median"]:
            result[f"block_reduction_without_wait_x_{tag}"] = round(
                sync["ckpt_block_s_median"] / run["block_without_wait_s_median"], 1)
        if sync["ckpt_block_s_median"] and run["ckpt_block_s_median"]:
            result[f"block_reduction_x_{tag}"] = round(sync["ckpt_block_s_median"] / run["ckpt_block_s_median"], 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
