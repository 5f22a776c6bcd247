"""`seqtrain run` end to end on this machine: real rank processes (gloo), real kills, real restarts.

One tiny GPT job (2 replicas x 1 process, seqLen 32) is run uninterrupted once (the reference) and then interrupted
in different ways; every interrupted run must end with exactly the reference's per-step losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

STEPS = 40
JOB = f"""\
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata:
  name: tiny-local
spec:
  replicas: 2
  resources: {{gpus: 0}}
  model: {{arch: gpt, preset: tiny}}
  data: {{source: builtin, seqLen: 32}}
  training:
    steps: {STEPS}
    globalBatchSize: 8
    microBatchSize: 4
    optimizer: {{lr: 0.003}}
    schedule: {{name: cosine, warmupSteps: 5}}
  checkpoint: {{intervalSteps: 10, keep: 2}}
  faultTolerance: {{maxRestarts: 2, backoffSeconds: 0.5}}
"""
RUN_TIMEOUT = 180  # seconds; a run takes ~10-20 s on 2 cores


@pytest.fixture(scope="module")
def job_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("job") / "job.yaml"
    p.write_text(JOB)
    return p


def seqtrain(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    full = dict(os.environ)
    full.update(env or {})
    # SIGINT as at a terminal: a suite started in the background by a shell without job control (`make test &` in
    # a script) inherits SIGINT ignored, and Python then installs no Ctrl-C handler in the child
    return subprocess.Popen([sys.executable, "-m", "seqtrain_operator.cli", *args], env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"seqtrain run did not finish within {RUN_TIMEOUT}s:\n{out}")
    return proc.returncode, out


def run(job: Path, workdir: Path, *sets: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    args = ["run", str(job), "--workdir", str(workdir), "-q"]
    for s in sets:
        args += ["--set", s]
    return finish(seqtrain(*args, env=env))


def wait_for(what: str, cond: Callable[[], Any], proc: subprocess.Popen, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"run ended (rc {proc.returncode}) before {what}:\n{proc.stdout.read()}")  # type: ignore[union-attr]
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def losses(workdir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["step"] not in out, f"step {rec['step']} appears twice in metrics.jsonl"
        out[rec["step"]] = rec["loss"]
    return out


def last_step(workdir: Path) -> int:
    try:
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def status(workdir: Path) -> dict[str, Any]:
    return json.loads((workdir / "status.json").read_text())


def rank_pids(workdir: Path) -> dict[int, int] | None:
    try:
        data = json.loads((workdir / "gang.json").read_text())
    except (OSError, ValueError):
        return None
    return {r["rank"]: r["pid"] for r in data["ranks"]}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def complete_steps(workdir: Path) -> list[int]:
    ck = workdir / "checkpoints"
    return sorted(int(p.name[5:]) for p in ck.glob("step-*") if (p / "meta.json").is_file())


@pytest.fixture(scope="module")
def reference(job_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    wd = tmp_path_factory.mktemp("reference")
    rc, out = run(job_file, wd)
    assert rc == 0, out
    return wd


def test_success_path_writes_the_run_folder(reference: Path) -> None:
    st = status(reference)
    assert st["phase"] == "Succeeded" and st["restarts"] == 0 and st["worldSize"] == 2
    assert st["progress"]["step"] == STEPS and st["layout"] == {"dp": 2, "tp": 1, "pp": 1}
    assert [p["ranks"] for p in st["placement"]] == [[0], [1]]
    ls = losses(reference)
    assert sorted(ls) == list(range(1, STEPS + 1))
    first, last = sum(ls[s] for s in range(1, 6)) / 5, sum(ls[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert complete_steps(reference) == [STEPS - 10, STEPS]  # keep: 2
    assert (reference / "loss.png").stat().st_size > 1000
    assert not (reference / "gang.json").exists()
    assert 0 < st["goodput"] <= 1  # productive time over wall time (start-up counts against it)


def test_rerun_of_finished_job_says_so(job_file: Path, reference: Path) -> None:
    before = (reference / "status.json").read_text()
    rc, out = run(job_file, reference)
    assert rc == 0 and "already finished" in out
    assert (reference / "status.json").read_text() == before


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "re-created"])
def test_rank_killed_from_outside_restarts_once_with_identical_losses(job_file: Path, reference: Path,
                                                                     tmp_path: Path, in_place: bool) -> None:
    # The first attempt holds after step 12 (until stopped): the kill lands mid-run however fast the machine is.
    # In place (the default), the replica processes (each pod's launcher) survive and restart their ranks: still
    # attempt 1; with faultTolerance.inPlaceRestarts: 0 the gang is re-created as attempt 2 (the old behaviour).
    hold = {"SEQTRAIN_FAULT_HOLD_AT_STEP": "12", "SEQTRAIN_FAULT_ATTEMPT": "1"}
    sets = [] if in_place else ["--set", "faultTolerance.inPlaceRestarts=0"]
    proc = seqtrain("run", str(job_file), "--workdir", str(tmp_path), "-q", *sets, env=hold)
    wait_for("step 12", lambda: last_step(tmp_path) >= 12, proc)
    # step 10's save is written in the background (checkpoint.asyncSave): killed before it is published, the ranks
    # would resume from scratch, a race with machine speed
    wait_for("checkpoint step 10 published", lambda: 10 in complete_steps(tmp_path), proc)
    pids = rank_pids(tmp_path)
    assert pids is not None
    os.kill(pids[1], signal.SIGKILL)
    rc, out = finish(proc)
    assert rc == 0, out
    st = status(tmp_path)
    assert st["phase"] == "Succeeded" and st["restarts"] == 1, st
    assert (st["attempt"], st.get("inPlaceRestarts", 0)) == ((1, 1) if in_place else (2, 0)), st
    assert not any(alive(p) for p in pids.values())
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    if in_place:
        (restarted,) = [e for e in events if e["reason"] == "RestartedInPlace"]
        assert "mode: in-place" in restarted["message"] and "checkpoint step 10" in restarted["message"]
        assert not any(e["reason"] == "Restarted" for e in events)  # no gang was re-created
        assert not (tmp_path / "attempts" / "2").exists()
        for replica in (0, 1):  # the same replica process started its rank twice
            said = (tmp_path / "attempts" / "1" / f"replica-{replica}.log").read_text()
            assert "in-place restart 1: starting 1 local rank(s) again" in said
    else:
        warning = next(e for e in events if e["type"] == "Warning")
        assert "SIGKILL" in warning["message"]
        assert any(e["reason"] == "Restarted" and "mode: re-created" in e["message"] for e in events)
    assert losses(tmp_path) == losses(reference)
    assert st["stepsLost"] and st["goodput"] < 1  # redone steps count against goodput


def test_kill_while_a_checkpoint_is_written_never_publishes_it(job_file: Path, reference: Path,
                                                               tmp_path: Path) -> None:
    # Rank 0 sleeps inside the save of step 20 (first attempt only): every rank's files are in .tmp-step-20, meta.json
    # is not written yet. SIGKILL it there, from outside.
    hook = {"SEQTRAIN_FAULT_IN_SAVE": "sleep:60", "SEQTRAIN_FAULT_SAVE_STEP": "20", "SEQTRAIN_FAULT_ATTEMPT": "1"}
    proc = seqtrain("run", str(job_file), "--workdir", str(tmp_path), "-q", env=hook)
    log0 = tmp_path / "attempts" / "1" / "rank-0.log"
    wait_for("rank 0 inside the save of step 20",
             lambda: log0.exists() and "fault injection in checkpoint save of step 20" in log0.read_text(), proc)
    tmp_ck = tmp_path / "checkpoints" / ".tmp-step-20"
    assert tmp_ck.is_dir() and any(tmp_ck.iterdir())
    assert complete_steps(tmp_path) == [10]
    pids = rank_pids(tmp_path)
    assert pids is not None
    os.kill(pids[0], signal.SIGKILL)
    rc, out = finish(proc)
    assert rc == 0, out
    st = status(tmp_path)
    assert st["phase"] == "Succeeded" and st["restarts"] == 1
    restarted = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    # (in place: the launchers restart the ranks; a re-created gang would say the same step)
    assert any(e["reason"] in ("Restarted", "RestartedInPlace") and "from checkpoint step 10" in e["message"]
               for e in restarted)
    assert losses(tmp_path) == losses(reference)
    assert not (tmp_path / "checkpoints" / ".tmp-step-20").exists()  # cleaned up by a later save


def test_ctrl_c_suspends_and_the_next_run_resumes(job_file: Path, reference: Path, tmp_path: Path) -> None:
    # The run holds after step 15 until stopped: Ctrl-C always lands mid-run, never after the job finished.
    proc = seqtrain("run", str(job_file), "--workdir", str(tmp_path), "-q", env={"SEQTRAIN_FAULT_HOLD_AT_STEP": "15"})
    wait_for("step 15", lambda: last_step(tmp_path) >= 15, proc)
    pids = rank_pids(tmp_path)
    assert pids is not None
    proc.send_signal(signal.SIGINT)
    rc, out = finish(proc)
    assert rc == 130, out
    st = status(tmp_path)
    assert st["phase"] == "Suspended" and "resume" in st["message"], st
    assert not any(alive(p) for p in pids.values())
    saved = complete_steps(tmp_path)
    assert saved and saved[-1] == 15  # the trainer saved on SIGTERM, at the step it was held at
    rc, out = run(job_file, tmp_path)
    assert rc == 0, out
    st = status(tmp_path)
    assert st["phase"] == "Succeeded" and st["restarts"] == 0
    assert losses(tmp_path) == losses(reference)


def test_max_restarts_exhausted_fails_with_exit_1(job_file: Path, tmp_path: Path) -> None:
    # Rank 1 kills itself after step 3 in every attempt: 1 restart allowed, so the second death is final. The one
    # restart is made in place (attempt 1, its launchers restart the ranks), and it is charged all the same.
    rc, out = run(job_file, tmp_path, "faultTolerance.maxRestarts=1",
                  env={"SEQTRAIN_FAULT_KILL_AT_STEP": "3:1"})
    assert rc == 1, out
    st = status(tmp_path)
    assert st["phase"] == "Failed" and st["restarts"] == 1 and st["attempt"] == 1 and st["inPlaceRestarts"] == 1
    assert "maxRestarts (1) reached" in st["message"]
    assert "Failed" in out and "rank-1.log" in out


def test_identical_start_up_failure_stops_after_the_second_attempt(job_file: Path, tmp_path: Path) -> None:
    # Every attempt fails the same way before its first step: the second identical failure ends the job with the
    # budget (5 restarts) nearly untouched, and the status says why.
    rc, out = run(job_file, tmp_path, "faultTolerance.maxRestarts=5",
                  env={"SEQTRAIN_FAULT_SETUP_ERROR": "cannot open /data/shard-7: read-only file system"})
    assert rc == 1, out
    st = status(tmp_path)
    assert st["phase"] == "Failed" and st["attempt"] == 2 and st["restarts"] == 1, st
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "StartupFailure"
    assert "deterministic start-up failure" in st["message"]
    assert "RuntimeError: cannot open /data/shard-7: read-only file system" in st["message"]


def test_deepspeed_trains_with_a_single_rank(job_file: Path, tmp_path: Path) -> None:
    # One rank (a laptop, a single-GPU box) is a legitimate DeepSpeed layout: no process group from the launcher.
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()  # DeepSpeed's CPU communication op: compiled once into TORCH_EXTENSIONS_DIR (minutes), then loaded
    rc, out = run(job_file, tmp_path, "replicas=1", "optimization.engine=deepspeed", "optimization.zero.stage=2",
                  "training.steps=2", "training.schedule.warmupSteps=1", "faultTolerance.maxRestarts=0")
    assert rc == 0, out
    st = status(tmp_path)
    assert st["phase"] == "Succeeded" and st["restarts"] == 0, st
    assert sorted(losses(tmp_path)) == [1, 2]


class _Payload:
    """Unpickling this runs a shell command: what a planted checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def _plant(step_dir: Path, name: str, marker: Path) -> None:
    """Replace a file with a payload pickle and, as an attacker with write access would, fix meta.json's sizes and
    hashes."""
    import hashlib
    import pickle

    import torch

    torch.save({"step": 20, "evil": _Payload(marker)}, step_dir / name, pickle_module=pickle)
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["sizes"][name] = (step_dir / name).stat().st_size
    meta["sha256"][name] = hashlib.sha256((step_dir / name).read_bytes()).hexdigest()
    (step_dir / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", ["planted-pickle", "truncated"])
def test_unusable_checkpoint_is_skipped_for_the_previous_one(damage: str, job_file: Path, reference: Path,
                                                             tmp_path: Path) -> None:
    import uuid

    # stop after the checkpoint of step 20 (SIGTERM-like: save, exit 143; no restart allowed)
    rc, out = run(job_file, tmp_path, "faultTolerance.maxRestarts=0", env={"SEQTRAIN_FAULT_TERM_AT_STEP": "20"})
    assert rc == 1 and complete_steps(tmp_path) == [10, 20], out
    step20 = tmp_path / "checkpoints" / "step-20"
    marker = Path(f"/tmp/PWNED-{uuid.uuid4().hex}")
    if damage == "planted-pickle":
        _plant(step20, "trainer.pt", marker)
        want = "trainer.pt: refused"
    else:
        engine = step20 / "state" / "__0_0.distcp"  # the DCP format's data file
        engine.write_bytes(engine.read_bytes()[: engine.stat().st_size // 2])
        want = "__0_0.distcp: "
    rc, out = run(job_file, tmp_path)
    assert not marker.exists(), "the planted payload ran"
    assert rc == 0, out
    assert "Traceback" not in out
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["reason"] == "CheckpointSkipped"]
    assert len(skipped) == 1 and want in skipped[0]["message"] and "step 20" in skipped[0]["message"], skipped
    st = status(tmp_path)
    assert st["phase"] == "Succeeded" and want in st["skippedCheckpoints"]["20"]
    assert (tmp_path / "checkpoints" / ".bad-step-20" / "REASON").is_file()  # kept for inspection
    # The progress document says so too: on Kubernetes the operator reads it (GET /progress, or the termination
    # message) and makes the same Warning Event.
    [reported] = json.loads((tmp_path / "progress.json").read_text())["skippedCheckpoints"]
    assert reported["step"] == 20 and want in reported["reason"], reported
    assert losses(tmp_path) == losses(reference)  # resumed exactly from step 10


def test_a_replica_of_two_ranks_runs_the_pod_command_with_the_same_losses(job_file: Path, reference: Path,
                                                                          tmp_path: Path) -> None:
    # 1 replica x 2 processes: the runner starts `seqtrain train --config F --nproc-per-node=2` (the pod's command),
    # whose launcher starts the ranks; same world and data parallel degree as the reference, so the same losses.
    rc, out = run(job_file, tmp_path, "replicas=1", "resources.processesPerReplica=2")
    assert rc == 0, out
    assert losses(tmp_path) == losses(reference)
    attempt = tmp_path / "attempts" / "1"
    assert {"rank-0.log", "rank-1.log", "replica-0.log", "replica-0.pids"} <= {p.name for p in attempt.iterdir()}


def test_invalid_spec_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(JOB.replace("replicas: 2", "replicas: 0").replace("seqLen: 32", "seqLen: -4"))
    wd = tmp_path / "run"
    rc, out = run(bad, wd)
    assert rc == 2
    lines = out.strip().splitlines()
    assert any(line.startswith(f"{bad}: spec.replicas:") for line in lines), out
    assert any(line.startswith(f"{bad}: spec.data.seqLen:") for line in lines), out
    assert "Traceback" not in out
    assert not wd.exists()
