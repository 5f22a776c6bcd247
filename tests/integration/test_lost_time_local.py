"""Where the time went, on a real local run: 2 gloo ranks, one SIGKILLed by the fault variables after step 15
(checkpoints every 10 steps, saved synchronously: an async save of step 10 could still be writing at step 15 on a
loaded machine, and the restart would rightly start from step 0), the gang restarted from step 10. status.json breaks the wall time down by reason and
the figures add up; `seqtrain report` shows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

JOB = """\
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata:
  name: lost-time
spec:
  replicas: 2
  resources: {gpus: 0}
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 32}
  training: {steps: 30, globalBatchSize: 8, microBatchSize: 4}
  checkpoint: {intervalSteps: 10, keep: 2, asyncSave: false}
  faultTolerance: {maxRestarts: 2, backoffSeconds: 0.5}
"""
RUN_TIMEOUT = 300


def _seconds(a: str, b: str) -> float:
    return (datetime.fromisoformat(b.replace("Z", "+00:00")) - datetime.fromisoformat(a.replace("Z", "+00:00"))
            ).total_seconds()


def test_a_crashed_and_restarted_run_says_where_its_time_went(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    wd = tmp_path / "run"
    env = {**os.environ, "SEQTRAIN_FAULT_KILL_AT_STEP": "15:1", "SEQTRAIN_FAULT_ATTEMPT": "1"}
    out = subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", "run", str(job), "--workdir", str(wd), "-q"],
                         env=env, text=True, capture_output=True, timeout=RUN_TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    st = json.loads((wd / "status.json").read_text())
    assert st["phase"] == "Succeeded" and st["restarts"] == 1, st
    # steps 11..15 (or up to the step the controller saw before the crash) are redone from checkpoint 10
    assert len(st["stepsLost"]) == 1 and 1 <= st["stepsLost"][0] <= 5, st["stepsLost"]
    lost = st["lostSeconds"]
    # the crash: from rank 1's last step until attempt 2 trained, and steps 11..15 computed twice
    assert lost["restart"] > 0 and lost["recomputed"] > 0
    # two gangs started (imports, rendezvous, model build), five saves (10, 20 in attempt 1; 20, 30 and the end)
    assert lost["startup"] > 0 and lost["checkpointStall"] > 0 and lost["suspended"] == 0
    # productive + every lost reason = the wall time from the run's first pass (which created the gang at once)
    # to its completion; goodput is the productive share of it
    wall = _seconds(st["startTime"], st["completionTime"])
    total = st["productiveSeconds"] + sum(lost.values())
    assert total == pytest.approx(wall, abs=0.02) and st["productiveSeconds"] > 0
    assert st["goodput"] == pytest.approx(st["productiveSeconds"] / total, abs=1e-4)

    report = subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", "report", str(wd)], text=True,
                            capture_output=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert report.returncode == 0, report.stderr
    summary = json.loads((wd / "report.json").read_text())
    assert summary["lost_s"]["recomputed"] == lost["recomputed"] and summary["productive_s"] == st["productiveSeconds"]
    assert "lost time by reason" in report.stdout and "recomputed" in report.stdout
