"""Local gang mechanics with tiny fake ranks (no torch): bootstrap environment, observation, stop with deadline,
and the run folder helpers (status.json, checkpoints, metrics tail)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from seqtrain.spec.status import JobStatus
from seqtrain_operator.controller import classify
from seqtrain_operator.local.files import MetricsTail, latest_checkpoint, read_status, write_status
from seqtrain_operator.local.gang import LocalGang


def fake(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def wait_until(cond, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    pytest.fail(f"condition not met within {timeout}s")


@pytest.mark.slow
def test_ranks_get_the_pod_bootstrap_environment(tmp_path: Path) -> None:
    dump = ("import json, os, sys; keys = ['RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR',"
            " 'MASTER_PORT', 'SEQTRAIN_ATTEMPT', 'SEQTRAIN_REPLICA', 'CUDA_VISIBLE_DEVICES'];"
            f" json.dump({{k: os.environ.get(k) for k in keys}}, open(r'{tmp_path}/env-' + os.environ['RANK'], 'w'))")
    gang = LocalGang.start(3, replicas=2, procs_per_replica=2, gpus_per_replica=2, config_path="unused",
                           log_dir=str(tmp_path / "logs"), command=fake(dump))
    wait_until(lambda: all(r.phase == "Succeeded" for r in gang.observe()))
    envs = [json.loads((tmp_path / f"env-{r}").read_text()) for r in range(4)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["SEQTRAIN_REPLICA"]) for e in envs] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and {e["MASTER_PORT"] for e in envs} == {str(gang.port)}
    assert {e["SEQTRAIN_ATTEMPT"] for e in envs} == {"3"}
    # like a pod, each replica sees only its own GPUs
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "0,1", "2,3", "2,3"]
    gang.stop(grace=0)


@pytest.mark.slow
def test_observe_reports_failures_with_exit_codes(tmp_path: Path) -> None:
    code = ("import os, signal, time, sys\nr = int(os.environ['RANK'])\n"
            "if r == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
            "if r == 2: sys.exit(3)\ntime.sleep(60)")
    gang = LocalGang.start(1, replicas=3, procs_per_replica=1, gpus_per_replica=0, config_path="unused",
                           log_dir=str(tmp_path), command=fake(code))
    wait_until(lambda: sum(r.phase == "Failed" for r in gang.observe()) == 2)
    obs = {r.replica: r for r in gang.observe()}
    assert obs[0].phase == "Running"
    assert obs[1].exit_code == 137 and "SIGKILL" in obs[1].message
    assert obs[2].exit_code == 3 and obs[2].attempt == 1
    gang.stop(grace=0)
    assert not gang.alive()


@pytest.mark.slow
def test_stop_escalates_to_sigkill_after_the_deadline_and_kills_children(tmp_path: Path) -> None:
    # The rank ignores SIGTERM and has a child of its own: both must be gone after stop().
    code = ("import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open(r'{tmp_path}/child', 'w').write(str(c.pid))\ntime.sleep(60)")
    gang = LocalGang.start(1, replicas=1, procs_per_replica=1, gpus_per_replica=0, config_path="unused",
                           log_dir=str(tmp_path), command=fake(code))
    wait_until(lambda: (tmp_path / "child").exists() and (tmp_path / "child").read_text() != "")
    child = int((tmp_path / "child").read_text())
    gang.stop(grace=0.5)
    assert not gang.alive()
    assert gang.observe()[0].exit_code == 137  # SIGKILL after the grace, not the end of its 60 s sleep
    wait_until(lambda: not _alive(child))


@pytest.mark.slow
def test_graceful_stop_lets_a_rank_exit_143(tmp_path: Path) -> None:
    code = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
            f"open(r'{tmp_path}/ready', 'w').close()\ntime.sleep(60)")
    gang = LocalGang.start(1, replicas=1, procs_per_replica=1, gpus_per_replica=0, config_path="unused",
                           log_dir=str(tmp_path), command=fake(code))
    wait_until(lambda: (tmp_path / "ready").exists())
    gang.stop(grace=20)
    assert gang.observe()[0].exit_code == 143


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_status_roundtrip_is_atomic_and_tolerates_garbage(tmp_path: Path) -> None:
    assert read_status(str(tmp_path)) is None
    write_status(str(tmp_path), JobStatus(phase="Running", restarts=2))
    st = read_status(str(tmp_path))
    assert st is not None and st.phase == "Running" and st.restarts == 2
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temp files left behind
    (tmp_path / "status.json").write_text("{not json")
    assert read_status(str(tmp_path)) is None


def test_latest_checkpoint_ignores_partial_ones(tmp_path: Path) -> None:
    # step-30 has no meta.json, step-50's meta lists a file that is missing, .tmp-step-40 is a save in progress
    for name, meta in [("step-10", True), ("step-30", False), (".tmp-step-40", True), ("step-20", True),
                       ("step-50", True)]:
        (tmp_path / name).mkdir()
        if meta:
            step = int(name.rsplit("-", 1)[1])
            files = ["model.pt"] if step == 50 else []
            (tmp_path / name / "meta.json").write_text(json.dumps({"step": step, "files": files}))
    ck = latest_checkpoint(str(tmp_path))
    assert ck is not None and ck.step == 20 and ck.path.endswith("step-20")
    assert latest_checkpoint(str(tmp_path / "missing")) is None


def test_metrics_tail_follows_appends_partial_lines_and_rewrites(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(str(path))
    assert tail.progress() is None
    with open(path, "w") as f:
        f.write(json.dumps({"step": 1, "loss": 5.0, "tokens_per_s": 100.0, "time": 0}) + "\n")
        f.write('{"step": 2, "lo')  # a line being written
    p = tail.progress()
    assert p is not None and p.step == 1 and p.loss == 5.0 and p.last_tokens_per_second == 100.0
    with open(path, "a") as f:
        f.write('ss": 4.0}\n')
    assert tail.progress().step == 2  # type: ignore[union-attr]
    # the trainer rewrites the file on resume (drops steps past the checkpoint)
    tmp = tmp_path / "m.tmp"
    tmp.write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    os.replace(tmp, path)
    assert tail.progress().step == 1  # type: ignore[union-attr]


@pytest.mark.slow
def test_observe_carries_the_error_line_a_failing_rank_printed(tmp_path: Path) -> None:
    code = ("import sys\nprint('Traceback (most recent call last): ...', file=sys.stderr)\n"
            "print('seqtrain train: error: AssertionError: backend is not initialized', file=sys.stderr)\n"
            "sys.exit(1)")
    gang = LocalGang.start(1, replicas=1, procs_per_replica=1, gpus_per_replica=0, config_path="unused",
                           log_dir=str(tmp_path), command=fake(code))
    wait_until(lambda: gang.observe()[0].phase == "Failed")
    (obs,) = gang.observe()
    assert obs.exit_code == 1 and obs.error == "AssertionError: backend is not initialized"
    assert obs.message.startswith("AssertionError: backend is not initialized; log ") and obs.rank == 0


@pytest.mark.slow
def test_a_multi_rank_replica_runs_through_the_one_launcher(tmp_path: Path) -> None:
    # Rank 1 exits 3 (invalid config) while rank 0 sleeps: the launcher stops rank 0 and the replica's code is the
    # launcher's rule, as in a pod; every rank is known by pid and gone afterwards.
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
    gang = LocalGang.start(1, replicas=1, procs_per_replica=2, gpus_per_replica=0, config_path="unused",
                           log_dir=str(tmp_path), command=fake(code))
    wait_until(lambda: gang.observe()[0].phase == "Failed")
    (obs,) = gang.observe()
    # the rank the launcher reported first, not its peer it then stopped; the failure's message names it
    assert obs.exit_code == 3 and obs.rank == 1 and obs.message.endswith("rank-1.log")
    assert classify(obs, 2).message.startswith("replica 0 on localhost (rank 1) failed permanently (InvalidConfig")
    pids = gang.pids()
    assert sorted(pids) == [0, 1]
    gang.stop(grace=5)
    assert not gang.alive() and not any(_alive(p) for p in pids.values())
    assert (tmp_path / "rank-0.log").exists() and (tmp_path / "rank-1.log").exists()
    assert json.loads(gang.to_json())["ranks"] == [{"rank": r, "pid": pids[r]} for r in (0, 1)]


@pytest.mark.slow
def test_stopping_a_multi_rank_replica_reaches_every_rank(tmp_path: Path) -> None:
    code = f"import os, time\nopen(r'{tmp_path}/up-' + os.environ['RANK'], 'w').close()\ntime.sleep(60)"
    gang = LocalGang.start(1, replicas=1, procs_per_replica=2, gpus_per_replica=0, config_path="unused",
                           log_dir=str(tmp_path), command=fake(code))
    wait_until(lambda: (tmp_path / "up-0").exists() and (tmp_path / "up-1").exists() and len(gang.pids()) == 2)
    pids = gang.pids()
    gang.stop(grace=20)
    assert gang.observe()[0].exit_code == 143  # SIGTERM forwarded by the launcher, its ranks' code is the replica's
    assert not any(_alive(p) for p in pids.values())


@pytest.mark.slow
def test_an_echo_seen_first_is_not_reported_as_the_cause_of_the_gangs_death(tmp_path: Path) -> None:
    # Replica 0 exits 4 (its peer died, the collective broke) before the runner sees replica 1's SIGKILL. The core
    # must wait for replica 1 and name it.
    from seqtrain.spec import SeqTrainJob
    from seqtrain_operator.controller import Observed, decide, root_cause, utcnow
    from seqtrain_operator.controller.types import ReplicaObservation

    code = ("import os, signal, sys, time\nr = int(os.environ['RANK'])\n"
            "if r == 0: sys.exit(4)\ntime.sleep(1.0); os.kill(os.getpid(), signal.SIGKILL)")
    job = SeqTrainJob.model_validate({
        "apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "t"},
        "spec": {"replicas": 2, "training": {"steps": 100, "globalBatchSize": 16},
                 "faultTolerance": {"maxRestarts": 0, "inPlaceRestarts": 0}}})
    st = decide(job, JobStatus(), Observed(), utcnow()).status
    st = decide(job, st, Observed(replicas=(ReplicaObservation(0, 1, "Running"), ReplicaObservation(1, 1, "Running"))),
                utcnow()).status
    gang = LocalGang.start(1, replicas=2, procs_per_replica=1, gpus_per_replica=0, config_path="unused",
                           log_dir=str(tmp_path), command=fake(code))
    try:
        wait_until(lambda: gang.observe()[0].phase == "Failed")
        seen = gang.observe()
        assert seen[0].finished_at is not None and seen[1].phase == "Running"  # the echo first
        d = decide(job, st, Observed(replicas=seen), utcnow())
        assert d.status.phase == "Running", d.status.message  # waiting for the rest of the gang, charging nothing
        wait_until(lambda: all(r.phase == "Failed" for r in gang.observe()))
        final = gang.observe()
        assert root_cause(final).replica == 1  # type: ignore[union-attr]
        d = decide(job, st, Observed(replicas=final), utcnow())
        assert d.status.phase == "Failed" and "rank-1.log" in d.status.message, d.status.message
    finally:
        gang.stop(grace=0)
