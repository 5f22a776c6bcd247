"""checkpoint.intervalSteps: auto and checkpoint-aware preemption with real rank processes (gloo on CPU).

A save's cost is made meaningful with the fault variable that sleeps inside it (slow storage, as the trainer sees
it: training stands still until the save is published); a failure is a real SIGKILL of a rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seqtrain.checkpoint import latest_checkpoint
from seqtrain.parallel import launch
from seqtrain.spec import RuntimeConfig, load_job, resolve, write_trainer_config
from seqtrain.train.interval import interval_steps

pytestmark = pytest.mark.slow

JOB = """\
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: auto-interval}
spec:
  replicas: 2
  resources: {gpus: 0}
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 32}
  training: {steps: 30, globalBatchSize: 8, microBatchSize: 4}
  checkpoint: {intervalSteps: auto, keep: 2, asyncSave: false}
  faultTolerance: {maxRestarts: 2, backoffSeconds: 0.5}
"""
# asyncSave: false: the injected storage delay is then what a save blocks training for (async writes it behind it)
SAVE_SLEEP_S = 0.4
RUN_TIMEOUT = 240


def test_local_run_with_auto_interval_reports_the_measured_policy(tmp_path: Path) -> None:
    """Attempt 1 saves early to measure the save, rank 1 dies after step 12; the ranks restarted in place count the
    failure (a re-created attempt is told it in its config) and set the interval from the measured save cost, its step time and the job's own MTBF."""
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    workdir = tmp_path / "run"
    env = {**os.environ, "SEQTRAIN_FAULT_KILL_AT_STEP": "12:1", "SEQTRAIN_FAULT_ATTEMPT": "1",
           "SEQTRAIN_FAULT_SAVE_DELAY": str(SAVE_SLEEP_S)}  # every attempt's saves
    proc = subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", "run", str(job), "--workdir", str(workdir),
                           "-q"], env=env, text=True, capture_output=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = json.loads((workdir / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["restarts"] == 1
    policy = status["checkpointPolicy"]
    assert policy["sources"] == {"intervalSteps": "youngDaly", "saveSeconds": "measured", "mtbfSeconds": "measured"}
    assert policy["failures"] == 1
    assert policy["saveSeconds"] >= SAVE_SLEEP_S  # the blocking time of the save, the storage's sleep included
    # the one failure over the time the gang ran is the MTBF, and the interval follows from the figures shown
    assert policy["mtbfSeconds"] == pytest.approx(policy["exposureSeconds"], rel=1e-3)
    want, why = interval_steps(policy["saveSeconds"], policy["mtbfSeconds"], policy["stepSeconds"])
    assert why == "youngDaly" and abs(policy["intervalSteps"] - want) <= 1  # figures keep 6 significant digits
    # attempt 1 saved only at the measuring step (3): the prior (one rank's MTBF of ~50,000 hours) asks for no more
    # (the restart is in place by default: the round's ranks append to attempt 1's logs)
    logs = "".join(f.read_text() for f in sorted((workdir / "attempts").glob("*/rank-0.log")))
    assert "resumed from step 3" in logs and "(measured, 1 failure(s))" in logs, logs
    risk = status["workAtRisk"]  # at the end: the final checkpoint holds everything
    assert risk["checkpointStep"] == 30 and risk["steps"] == 0 and risk["checkpointAgeSeconds"] >= 0


TRAIN_JOB = """\
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: grace}
spec:
  replicas: 2
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 32}
  training: {steps: 1000, globalBatchSize: 8, microBatchSize: 2}
  checkpoint: {intervalSteps: 2, keep: 2}
"""


def _ranks(workdir: Path, env: dict[str, str]) -> list[subprocess.Popen]:
    job = resolve(load_job(TRAIN_JOB))
    write_trainer_config(str(workdir / "trainer.json"), job,
                         RuntimeConfig(workdir=str(workdir), checkpoint_dir=str(workdir / "checkpoints")))
    return launch.start_ranks(workdir / "trainer.json", workdir, 2, {"OMP_NUM_THREADS": "1", **env})


def _sigterm_at_hold(workdir: Path, grace_s: float) -> str:
    """Ranks hold after step 5 (saves of steps 2 and 4 measured the slow save); SIGTERM every rank; their log."""
    workdir.mkdir()
    procs = _ranks(workdir, {"SEQTRAIN_FAULT_HOLD_AT_STEP": "5", "SEQTRAIN_FAULT_SAVE_DELAY": str(SAVE_SLEEP_S),
                             "SEQTRAIN_TERM_GRACE_SECONDS": str(grace_s)})
    log = workdir / "rank0.log"
    deadline = time.monotonic() + RUN_TIMEOUT
    while "holding after step 5" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log.read_text()
        time.sleep(0.1)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=RUN_TIMEOUT) for p in procs]
    assert codes == [143, 143], log.read_text()
    return log.read_text()


def test_sigterm_saves_when_the_measured_save_fits_the_grace_period(tmp_path: Path) -> None:
    out = _sigterm_at_hold(tmp_path / "fits", grace_s=60)
    assert "SIGTERM at step 5: saving a checkpoint: the last save took" in out, out
    assert "SIGTERM save of step 5 done in" in out, out
    assert latest_checkpoint(str(tmp_path / "fits" / "checkpoints")).step == 5


def test_sigterm_skips_a_save_the_grace_period_would_cut(tmp_path: Path) -> None:
    out = _sigterm_at_hold(tmp_path / "short", grace_s=SAVE_SLEEP_S)  # a save takes longer than the whole grace
    assert "SIGTERM at step 5: not saving a checkpoint: the last save took" in out, out
    ckpts = tmp_path / "short" / "checkpoints"
    assert latest_checkpoint(str(ckpts)).step == 4
    assert not [n for n in os.listdir(ckpts) if n.startswith(".tmp")]  # no save begun that SIGKILL would cut
