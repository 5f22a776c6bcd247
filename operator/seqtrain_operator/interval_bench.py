"""`seqtrain bench checkpoint-interval`: goodput of `checkpoint.intervalSteps: auto` against fixed intervals that
are too short and too long, under failures injected at a known rate, in one run.

Every variant is the same local job (`seqtrain run`, the controller core restarting the gang after each failure)
with the same fault variables: rank 0 SIGKILLs itself after an exponentially distributed training time of mean
`--mtbf` seconds (SEQTRAIN_FAULT_MTBF_SECONDS, a seed per attempt, so every variant sees the same draws), and every
checkpoint save takes `--save-delay` seconds longer (SEQTRAIN_FAULT_SAVE_DELAY: the tiny model saves in
milliseconds; the delay stands for the storage time of a model worth checkpointing, and training stands still for
it as it would). A variant stops at the end of training or at `--cap` seconds (then it is stopped as Ctrl-C does,
Suspended). Variants: fixed `--short`, `auto` (the trainer's default prior, 50,000 hours per rank: it learns the
rate from the job's failures), `auto-prior` (`auto` told the injected rate as the cluster's prior through
SEQTRAIN_RANK_MTBF_HOURS, as a chart whose `operator.rankMtbfHours` knows its cluster would), fixed `--long`.

Two figures per variant: `goodput`, status.goodput as the controller defines it (seqtrain_operator.controller.goodput:
time Running x kept / computed steps, over wall time; it counts checkpoint stalls and each attempt's start-up as
productive), and `trainingGoodput`, useful training time over wall time, where useful training time is the steps
kept x one step time common to all variants (the median `step_time_s` of every step every variant ran, from
metrics.jsonl): the same work counts the same in every variant, whatever the load of a shared machine did to the
step time of one of them. What a save stall costs shows only in the second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

JOB = """\
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {{name: interval-{name}}}
spec:
  replicas: 1
  resources: {{gpus: 0}}
  model: {{arch: gpt, preset: tiny}}
  data: {{source: builtin, seqLen: 64}}
  training: {{steps: {steps}, globalBatchSize: 8, microBatchSize: 8, logEvery: 1000000}}
  checkpoint: {{intervalSteps: {interval}, keep: 1, asyncSave: false}}
  faultTolerance: {{maxRestarts: 10000, maxInfraRestarts: 10000, backoffSeconds: 0, maxBackoffSeconds: 0,
                   inPlaceRestarts: 0}}
"""
# asyncSave: false - the injected save delay stands in for a save's blocking cost (an async save would write it in
# the background); inPlaceRestarts: 0 - every failure re-creates the gang, as when these figures were measured


def _variant(name: str, interval: str, a: argparse.Namespace, tmp: str, prior_hours: float | None = None) -> dict[str, Any]:
    job = os.path.join(tmp, f"{name}.yaml")
    with open(job, "w", encoding="utf-8") as f:
        f.write(JOB.format(name=name, steps=a.steps, interval=interval))
    workdir = os.path.join(tmp, name)
    env = {**os.environ, "SEQTRAIN_FAULT_MTBF_SECONDS": f"{a.mtbf}:{a.seed}",
           "SEQTRAIN_FAULT_SAVE_DELAY": str(a.save_delay), "OMP_NUM_THREADS": "1"}
    if prior_hours is not None:  # the cluster's prior, as the chart's operator.rankMtbfHours would give it
        env["SEQTRAIN_RANK_MTBF_HOURS"] = str(prior_hours)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "seqtrain_operator.cli", "run", job, "--workdir", workdir, "-q"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    capped = False
    status_file = os.path.join(workdir, "status.json")
    try:
        proc.wait(timeout=a.cap)
        wall = time.monotonic() - started
        st = _read(status_file)
    except subprocess.TimeoutExpired:
        capped = True
        wall = time.monotonic() - started
        st = _read(status_file)  # the controller's last word while it ran (written atomically every decision)
        proc.send_signal(signal.SIGTERM)  # as Ctrl-C: the gang stops, the job is Suspended
        proc.wait(timeout=120)
    policy = st.get("checkpointPolicy") or {}
    steps = (st.get("progress") or {}).get("step", 0)
    step_times = [r["step_time_s"] for r in _metrics(os.path.join(workdir, "metrics.jsonl"))
                  if isinstance(r.get("step_time_s"), float)]
    return {"variant": name, "intervalSteps": interval, "chosenIntervalSteps": policy.get("intervalSteps"),
            "goodput": st.get("goodput"), "stepTimes": step_times, "phase": st.get("phase"), "capped": capped, "wallSeconds": round(wall, 1),
            "stepsDone": steps, "stepsPerWallSecond": round(steps / wall, 2) if wall > 0 else None,
            "restarts": st.get("restarts", 0) + st.get("infraRestarts", 0), "stepsLost": sum(st.get("stepsLost", [])),
            "checkpointPolicy": policy}


def _metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if isinstance(r.get("step"), int)]


def _read(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqtrain bench checkpoint-interval", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600, help="training steps of the job")
    p.add_argument("--mtbf", type=float, default=4.0, help="mean training seconds between injected failures")
    p.add_argument("--save-delay", type=float, default=0.25, help="seconds added to every checkpoint save")
    p.add_argument("--short", type=int, default=5, help="the too-short fixed interval (steps)")
    p.add_argument("--long", type=int, default=200, help="the too-long fixed interval (steps)")
    p.add_argument("--cap", type=float, default=150.0, help="wall seconds a variant may run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/checkpoint-interval-cpu.json")
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="seqtrain-interval-") as tmp:
        for name, interval, prior in (("short", str(a.short), None), ("auto", "auto", None),
                                      ("auto-prior", "auto", a.mtbf / 3600), ("long", str(a.long), None)):
            rows.append(_variant(name, interval, a, tmp, prior))
    step_s = statistics.median(t for row in rows for t in row["stepTimes"])
    for row in rows:
        row["medianStepSeconds"] = round(statistics.median(row.pop("stepTimes")), 4)
        row["usefulSeconds"] = round(row["stepsDone"] * step_s, 1)
        row["trainingGoodput"] = round(row["usefulSeconds"] / row["wallSeconds"], 4)
        print(f"{row['variant']:>10} interval {row['chosenIntervalSteps'] or row['intervalSteps']:>6}: goodput "
              f"{row['goodput']}, training goodput {row['trainingGoodput']}, {row['stepsDone']}/{a.steps} steps in "
              f"{row['wallSeconds']}s, {row['restarts']} restarts, {row['stepsLost']} steps redone"
              f"{' (capped)' if row['capped'] else ''}", flush=True)
    result = {"benchmark": "checkpoint-interval", "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
              "cpus": os.cpu_count(), "job": f"gpt tiny, seqLen 64, batch 8, 1 CPU process, {a.steps} steps",
              "mtbfSeconds": a.mtbf, "saveDelaySeconds": a.save_delay, "capSeconds": a.cap, "seed": a.seed,
              "commonStepSeconds": round(step_s, 4),
              "variants": rows}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
