"""One memory verdict: `plan` and `run` (and `validate`, through the same `seqtrain.spec.memory.memory_problems`)
refuse a job whose estimate, process baseline included, does not fit resources.memory, with one line naming the
field and the fix; the local backend kills a replica whose processes pass the limit, as a pod's cgroup would, and
the replica is then observed as OOMKilled (exit 137)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from seqtrain.spec import load_job_file
from seqtrain.spec.memory import BASELINE_BYTES, estimate, memory_problems, replica_need
from seqtrain_operator.controller.failure_policy import classify
from seqtrain_operator.controller.types import ReplicaObservation
from seqtrain_operator.local.memory_limit import OOM_EXIT, MemoryLimit, session_rss
from seqtrain_operator.local.runner import run_file
from seqtrain_operator.planner.show import plan_command

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")


def test_the_estimate_counts_the_process_baseline_of_every_rank() -> None:
    one = load_job_file(QUICKSTART)
    four = load_job_file(QUICKSTART, ["resources.processesPerReplica=4", "training.globalBatchSize=64"])
    est = estimate(one)
    assert est.host_per_rank(0) == pytest.approx(BASELINE_BYTES + est.busiest.total)
    assert replica_need(four, estimate(four)) == pytest.approx(4 * estimate(four).host_per_rank(0))
    assert replica_need(four, estimate(four)) > 4 * BASELINE_BYTES


@pytest.mark.parametrize("memory,fits", [("10Mi", False), ("500Mi", False), ("2Gi", True)])
def test_plan_and_run_give_one_verdict(memory: str, fits: bool, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    sets = [f"resources.memory={memory}"]
    problems = memory_problems(load_job_file(QUICKSTART, sets))
    assert (not problems) == fits
    plan_rc = plan_command(QUICKSTART, overrides=sets)
    plan_err = capsys.readouterr().err
    if fits:
        assert plan_rc == 0 and "resources.memory" not in plan_err
        return  # a run that fits trains: tests/integration/test_memory_limit.py
    run_rc = run_file(QUICKSTART, workdir=str(tmp_path / "run"), overrides=sets, quiet=True)
    run_err = capsys.readouterr().err
    assert plan_rc == run_rc == 2
    line = f"{QUICKSTART}: {problems[0]}"
    assert line in plan_err.splitlines() and line in run_err.splitlines()
    assert "spec.resources.memory" in line and "raise resources.memory to at least" in line and "baseline" in line
    assert not (tmp_path / "run" / "status.json").exists()  # refused before anything ran


@dataclass
class _Member:
    """The part of local.gang.Replica the limit reads: a one-rank replica (the process is the rank)."""

    replica: int
    proc: subprocess.Popen

    def rank_pids(self) -> dict[int, int]:
        return {self.replica: self.proc.pid}


HOG = "import sys, time; b = bytearray(int(sys.argv[1]) * 2**20); b[::4096] = b'x' * len(b[::4096]); " \
      "print('ready', flush=True); time.sleep(60)"


def _hog(mib: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOG, str(mib)], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.slow
def test_a_replica_over_resources_memory_is_killed_and_observed_as_oomkilled() -> None:
    small, big = _hog(20), _hog(200)
    try:
        assert session_rss({big.pid})[big.pid] >= 200 * 2**20
        limit = MemoryLimit("120Mi")
        said = limit.watch(1, [_Member(0, small), _Member(1, big)])
        assert len(said) == 1 and "resources.memory 120Mi" in said[0] and "replica 1" in said[0]
        deadline = time.monotonic() + 30
        while big.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert big.returncode == -9 and small.poll() is None
        seen = limit.observed(ReplicaObservation(1, 1, "Failed", exit_code=137, message="rank 1 killed; log x.log"))
        assert seen.reason == "OOMKilled" and seen.exit_code == OOM_EXIT
        assert limit.observed(ReplicaObservation(0, 1, "Running")).reason is None
        failure = classify(seen)
        assert failure.reason == "OOMKilled"
        assert "raise spec.resources.memory" in failure.message and "120Mi" in failure.message
        assert "\n" not in failure.message
        assert limit.peaks[1] >= 200 * 2**20
    finally:
        for p in (small, big):
            p.kill()
            p.wait()


def test_validate_gives_the_plans_memory_verdict(tmp_path, capsys) -> None:
    """validate, plan and run: one verdict. A replica too small for the estimate is refused at validate, naming the
    field and the size to ask for; one that fits gets the estimate as a note."""
    from seqtrain_operator.cli import main as cli_main

    job = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    assert cli_main(["validate", str(job), "--set", "spec.resources.memory=100Mi"]) == 2
    err = capsys.readouterr().err
    assert "spec.resources.memory: the estimate needs" in err and "raise resources.memory to at least" in err, err
    assert cli_main(["validate", str(job)]) == 0
    assert "note: memory: a replica needs" in capsys.readouterr().out


def test_the_walkthroughs_770mi_quickstart_is_refused_with_a_size_that_leaves_room() -> None:
    """A newcomer's 770Mi quickstart passed the verdict (baseline measured over two synthetic steps) and was then
    OOM-killed at every restart: its ranks peaked at 774-853 MiB. The baseline now includes what a run does besides
    its steps, and the message gives a size with room beside the bare minimum."""
    job = load_job_file(QUICKSTART, ["resources.memory=770Mi"])
    [problem] = memory_problems(job)
    need = replica_need(job, estimate(job))
    assert need > 800 * 2**20
    assert f"at least {int(-(-need // 2**20))}Mi" in problem.message and "leaves room" in problem.message
    assert "(or set it to auto)" in problem.message  # a fixed micro-batch: auto is advice worth giving
    auto = load_job_file(QUICKSTART, ["resources.memory=600Mi", "training.microBatchSize=auto"])
    [problem] = memory_problems(auto)
    assert "set it to auto" not in problem.message and "training.globalBatchSize" in problem.message
