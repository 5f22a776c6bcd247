"""One runner per run folder: `seqtrain run` holds a lock on its workdir for its whole life.

The holder here is a small process that takes the same `flock` the runner takes, so no training starts; the run
folder says the job already Succeeded, so a runner that ignores the lock returns at once (exit 0) instead of
training. One test at the end runs two real runners on one folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from seqtrain_operator import cli

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"

_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the test closes our stdin
"""


def _finished(workdir: Path) -> None:
    from seqtrain.spec import load_job_file
    from seqtrain.spec.status import JobStatus, Progress
    from seqtrain_operator.local.files import write_status

    steps = load_job_file(str(QUICKSTART)).spec.training.steps
    workdir.mkdir(parents=True, exist_ok=True)
    write_status(str(workdir), JobStatus(phase="Succeeded", progress=Progress(step=steps, total_steps=steps)))


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    wd = tmp_path / "run"
    _finished(wd)
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(wd / "run.lock")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    yield proc
    proc.stdin.close()  # type: ignore[union-attr]
    proc.wait(timeout=30)


@pytest.mark.slow
def test_a_second_run_on_a_locked_folder_exits_2_naming_the_holder(
        holder: subprocess.Popen[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = tmp_path / "run"
    before = (wd / "status.json").read_text()
    assert cli.main(["run", str(QUICKSTART), "--workdir", str(wd)]) == 2
    err = capsys.readouterr().err
    assert f"is in use by another seqtrain run (pid {holder.pid}" in err, err
    assert "--workdir" in err and len(err.strip().splitlines()) == 1, err
    assert (wd / "status.json").read_text() == before  # nothing touched
    assert not (wd / "job.yaml").exists()


@pytest.mark.slow
def test_a_lock_left_by_a_dead_runner_is_taken_over_saying_so(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    wd = tmp_path / "run"
    _finished(wd)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    (wd / "run.lock").write_text(f"{dead.pid}\n")  # what a runner killed with SIGKILL leaves: its pid, no flock
    assert cli.main(["run", str(QUICKSTART), "--workdir", str(wd)]) == 0
    captured = capsys.readouterr()
    assert f"took over run folder {wd} from pid {dead.pid}, which ended without releasing it" in captured.err
    assert "already finished" in captured.out
    # released in order: empty, and free for the next runner (which therefore has nothing to take over)
    assert (wd / "run.lock").read_text() == ""
    fd = os.open(wd / "run.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert cli.main(["run", str(QUICKSTART), "--workdir", str(wd)]) == 0
    assert "took over" not in capsys.readouterr().err


TINY = """\
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: lock-tiny}
spec:
  replicas: 1
  resources: {gpus: 0}
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 16}
  training: {steps: 100000, globalBatchSize: 2, microBatchSize: 2}
  checkpoint: {intervalSteps: 100000}
"""


@pytest.mark.slow
def test_two_real_runners_on_one_folder_the_second_leaves_the_first_alone(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(TINY)
    wd = tmp_path / "run"
    argv = [sys.executable, "-m", "seqtrain_operator.cli", "run", str(job), "--workdir", str(wd), "-q"]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (wd / "gang.json").exists():  # the first runner has started its rank
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the first run started no rank within 120 s"
            time.sleep(0.05)
        ranks = json.loads((wd / "gang.json").read_text())
        # a runner that ignored the lock would stop the first one's rank and train these 2 steps, then exit 0
        second = subprocess.run([*argv, "--set", "training.steps=2"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"(pid {first.pid}," in second.stderr, second.stderr
        assert first.poll() is None  # its rank was not killed: the runner still runs its gang
        assert json.loads((wd / "gang.json").read_text())["replicas"] == ranks["replicas"]
    finally:
        first.send_signal(signal.SIGINT)
        try:
            out, _ = first.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            first.kill()
            out, _ = first.communicate()
    assert first.returncode == 130, out  # Suspended by our Ctrl-C, nothing else happened to it
    assert "Restart" not in (wd / "events.jsonl").read_text()
