"""Recovery time after a rank is SIGKILLed: in place (the launchers restart the ranks in the running replicas) vs
re-created (the whole gang is stopped and started again, faultTolerance.inPlaceRestarts: 0).

`seqtrain bench recovery [--job examples/quickstart.yaml] [--kill-at-step 20] [--repeats 2] [--out FILE]` runs the
job locally (`seqtrain run`, real rank processes) once per mode and repeat: when metrics.jsonl reaches the step (in
place: and the spare ranks are ready), it SIGKILLs rank 1 from outside and measures the seconds from the kill to the
next step any rank completes (the first metrics.jsonl record stamped after the kill), then stops the run. JSON out,
like the other benches; `backoffSeconds` is the job's, which both modes wait by policy.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

MODES = {"in-place": 2, "re-created": 0}  # faultTolerance.inPlaceRestarts


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _rank_pid(workdir: Path, rank: int) -> int | None:
    try:
        data = json.loads((workdir / "gang.json").read_text())
    except (OSError, ValueError):
        return None
    return next((r["pid"] for r in data.get("ranks", []) if r["rank"] == rank), None)


def _spares_ready(workdir: Path) -> int:
    """How many ranks have a spare ready (its imports done) for the next in-place restart (its line in the rank
    logs: seqtrain.runtime.restart.await_start)."""
    ready = set()
    for log in workdir.glob("attempts/*/rank-*.log"):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        if "ready for in-place restart" in text:
            ready.add(log.name)
    return len(ready)


def _backoff(job: str) -> float:
    with open(job, encoding="utf-8") as f:
        spec = (yaml.safe_load(f) or {}).get("spec") or {}
    return float((spec.get("faultTolerance") or {}).get("backoffSeconds", 0) or 0)


def measure(job: str, mode: str, kill_at: int, timeout: float) -> dict[str, Any]:
    """One run: kill rank 1 after step `kill_at`; seconds to the next completed step, and what the status says."""
    workdir = Path(tempfile.mkdtemp(prefix=f"seqtrain-bench-recovery-{mode}-"))
    cmd = [sys.executable, "-m", "seqtrain_operator.cli", "run", job, "--workdir", str(workdir), "-q",
           "--set", f"faultTolerance.inPlaceRestarts={MODES[mode]}"]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    try:
        while not any(r.get("step", 0) >= kill_at for r in _records(metrics)):
            if run.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: the run ended or timed out before step {kill_at}: {run.stdout.read()}")  # type: ignore[union-attr]
            time.sleep(0.02)
        pid = _rank_pid(workdir, 1)
        if pid is None:
            raise RuntimeError(f"{mode}: no pid of rank 1 in {workdir}/gang.json")
        world = len(json.loads((workdir / "gang.json").read_text()).get("ranks", []))
        # In place, the kill waits for the spare ranks' imports: a failure hours into a run finds them ready, one
        # a second after the start would not (the spares start after the round's first step).
        while MODES[mode] and _spares_ready(workdir) < world:
            if run.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: the spare ranks were never ready: {run.stdout.read()}")  # type: ignore[union-attr]
            time.sleep(0.02)
        at_step = max(r.get("step", 0) for r in _records(metrics))
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        while True:
            after = [r for r in _records(metrics) if float(r.get("time", 0)) > killed]
            if after:
                break
            if run.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: no step completed after the kill: {run.stdout.read()}")  # type: ignore[union-attr]
            time.sleep(0.02)
        first = min(after, key=lambda r: float(r["time"]))
        status: dict[str, Any] = {}
        settle = time.monotonic() + 30  # the run counts the restart a moment after the ranks report the step
        while time.monotonic() < settle and not status.get("restarts"):
            with contextlib.suppress(OSError, ValueError):
                status = json.loads((workdir / "status.json").read_text())
            time.sleep(0.1)
        return {"mode": mode, "seconds": round(float(first["time"]) - killed, 3), "killedAfterStep": at_step,
                "resumedAtStep": first["step"], "restarts": status.get("restarts"),
                "inPlaceRestarts": status.get("inPlaceRestarts", 0), "attempt": status.get("attempt")}
    finally:
        run.send_signal(signal.SIGINT)  # Ctrl-C: the run stops its gang in order
        try:
            run.wait(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqtrain bench recovery", description=__doc__.splitlines()[0])
    p.add_argument("--job", default="examples/quickstart.yaml", help="SeqTrainJob file (2 or more ranks)")
    p.add_argument("--kill-at-step", type=int, default=20, help="SIGKILL rank 1 once this step completed")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before giving up")
    p.add_argument("--out", help="write the JSON here (default: stdout)")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.kill_at_step < 1 or args.repeats < 1:
        p.error("--kill-at-step and --repeats must be at least 1")
    if not os.path.isfile(args.job):
        p.error(f"--job {args.job}: no such file")
    runs = [measure(args.job, mode, args.kill_at_step, args.timeout) for _ in range(args.repeats) for mode in MODES]
    summary = {mode: statistics.median(r["seconds"] for r in runs if r["mode"] == mode) for mode in MODES}
    result = {"benchmark": "recovery", "backend": "local",
              "command": "seqtrain bench recovery " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": dt.date.today().isoformat(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "job": args.job, "backoffSeconds": _backoff(args.job), "runs": runs, "medianSeconds": summary,
              "speedup": round(summary["re-created"] / summary["in-place"], 2) if summary["in-place"] else None}
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text, end="")
    return 0
