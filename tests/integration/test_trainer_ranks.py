"""`seqtrain train` as real rank processes (2 x gloo on CPU), without the controller: metrics, checkpoints,
SIGTERM handling, exact resume after a stop and after a crash, exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seqtrain.checkpoint import latest_checkpoint, list_checkpoints
from seqtrain.parallel import launch
from seqtrain.spec import RuntimeConfig, load_job, resolve, write_trainer_config

pytestmark = pytest.mark.slow

TINY = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: tiny}
spec:
  replicas: 2
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 32}
  training:
    steps: 8
    globalBatchSize: 8
    microBatchSize: 2
    optimizer: {lr: 0.003}
    schedule: {name: cosine, warmupSteps: 2}
  checkpoint: {intervalSteps: 3, keep: 2}
"""
DEADLINE_S = 120


def make_run(tmp_path: Path, name: str, overrides: tuple[str, ...] = ()) -> Path:
    workdir = tmp_path / name
    workdir.mkdir()
    job = resolve(load_job(TINY, overrides))
    write_trainer_config(str(workdir / "trainer.json"), job,
                         RuntimeConfig(workdir=str(workdir), checkpoint_dir=str(workdir / "checkpoints")))
    return workdir


def start_ranks(workdir: Path, world: int = 2, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    # identities and rendezvous as the one launcher gives them (seqtrain.runtime.launch.rank_envs)
    return launch.start_ranks(workdir / "trainer.json", workdir, world, {"OMP_NUM_THREADS": "1", **(env or {})})


def wait_all(procs: list[subprocess.Popen], deadline_s: float = DEADLINE_S) -> list[int]:
    end = time.monotonic() + deadline_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("rank processes did not finish before the deadline") from None
    return codes


def run_ranks(workdir: Path, world: int = 2, env: dict[str, str] | None = None) -> list[int]:
    return wait_all(start_ranks(workdir, world, env))


def metrics(workdir: Path) -> list[dict]:
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def logs(workdir: Path) -> str:
    return "\n".join((workdir / f"rank{r}.log").read_text() for r in range(2) if (workdir / f"rank{r}.log").exists())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 2-rank run that the resume tests compare with."""
    workdir = make_run(tmp_path_factory.mktemp("ref"), "ref")
    codes = run_ranks(workdir)
    assert codes == [0, 0], logs(workdir)
    return workdir


def test_uninterrupted_run_writes_metrics_and_checkpoints(reference: Path) -> None:
    rows = metrics(reference)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:
        for key in ("loss", "lr", "grad_norm", "tokens", "slots", "tokens_per_s", "mem_peak_mb", "time"):
            assert key in r, key
        assert r["tokens"] == 8 * 32 and r["slots"] == 8 * 32  # global batch: both ranks counted
        assert r["mem_peak_mb"] > 10
    assert rows[-1]["loss"] < rows[0]["loss"]
    # warmup 2 -> the second step runs at the peak, cosine decays after it
    assert rows[1]["lr"] == pytest.approx(0.003) and rows[-1]["lr"] == pytest.approx(0.0003)
    # interval 3 + the final step, keep 2
    assert [c.step for c in list_checkpoints(str(reference / "checkpoints"))] == [6, 8]
    meta = latest_checkpoint(str(reference / "checkpoints")).meta
    assert meta["world"] == 2 and meta["layout"] == {"dp": 2, "tp": 1, "pp": 1}
    assert {"state", "trainer.pt", "rng-rank0.pt", "rng-rank1.pt"} <= set(meta["files"])
    assert not [n for n in os.listdir(reference / "checkpoints") if n.startswith(".")]


def test_stop_crash_and_save_crash_then_resume_is_bit_exact(tmp_path: Path, reference: Path) -> None:
    """One run interrupted three ways, resumed each time; it ends with exactly the reference's losses. Synchronous
    saves: each crash point is inside or after a save that has finished (an async save cut by a crash is lost
    instead, the previous checkpoint kept: tests/integration/test_async_checkpoints.py)."""
    workdir = make_run(tmp_path, "interrupted", ("checkpoint.asyncSave=false",))
    ckpts = str(workdir / "checkpoints")
    # 1. As if SIGTERM arrived in step 2: every rank finishes it, saves step-2 (off the interval), exits 143.
    assert run_ranks(workdir, env={"SEQTRAIN_FAULT_TERM_AT_STEP": "2"}) == [143, 143], logs(workdir)
    assert latest_checkpoint(ckpts).step == 2
    assert [r["step"] for r in metrics(workdir)] == [1, 2]
    # 2. Rank 1 dies after step 5 (step-3 is the latest checkpoint); rank 0 loses its peer and fails too.
    codes = run_ranks(workdir, env={"SEQTRAIN_FAULT_KILL_AT_STEP": "5:1"})
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, logs(workdir)
    assert "resumed from step 2" in logs(workdir)
    assert latest_checkpoint(ckpts).step == 3
    # 3. Rank 0 dies inside the save of step 6, after all files were written, before publishing.
    codes = run_ranks(workdir, env={"SEQTRAIN_FAULT_IN_SAVE": "crash", "SEQTRAIN_FAULT_SAVE_STEP": "6"})
    assert codes[0] == -signal.SIGKILL, logs(workdir)
    names = os.listdir(ckpts)
    assert ".tmp-step-6" in names and "step-6" not in names  # written, never published
    assert latest_checkpoint(ckpts).step == 3
    # 4. The last attempt runs to the end; redone steps replaced their earlier lines in metrics.jsonl.
    assert run_ranks(workdir) == [0, 0], logs(workdir)
    rows = metrics(workdir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == [r["loss"] for r in metrics(reference)]
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in metrics(reference)]
    assert [c.step for c in list_checkpoints(ckpts)] == [6, 8]
    assert not [n for n in os.listdir(ckpts) if n.startswith(".")]  # leftovers pruned
    # 5. Started again after the end: nothing to do, nothing rewritten.
    assert run_ranks(workdir) == [0, 0], logs(workdir)
    assert metrics(workdir) == rows


def test_sigterm_from_outside_saves_and_exits_143(tmp_path: Path) -> None:
    workdir = make_run(tmp_path, "sigterm", ("training.steps=100000", "checkpoint.intervalSteps=100000"))
    procs = start_ranks(workdir)
    end = time.monotonic() + DEADLINE_S
    while not (workdir / "metrics.jsonl").exists() or len(metrics(workdir)) < 3:
        assert time.monotonic() < end and all(p.poll() is None for p in procs), logs(workdir)
        time.sleep(0.1)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    assert wait_all(procs) == [143, 143], logs(workdir)
    last = metrics(workdir)[-1]["step"]
    assert latest_checkpoint(str(workdir / "checkpoints")).step == last < 100000


def test_lstm_trains_through_the_same_loop_single_process(tmp_path: Path) -> None:
    workdir = make_run(tmp_path, "lstm", ("model.arch=lstm", "model.preset=tiny", "training.steps=4",
                                          "checkpoint.intervalSteps=2", "replicas=1"))
    assert run_ranks(workdir, world=1) == [0], logs(workdir)
    rows = metrics(workdir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]
    assert latest_checkpoint(str(workdir / "checkpoints")).step == 4


def test_invalid_config_exits_3_without_starting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"job": {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob",
                                       "metadata": {"name": "x"}, "spec": {"replicas": 0}},
                               "runtime": {"workdir": str(tmp_path), "checkpointDir": str(tmp_path / "c")}}))
    out = subprocess.run([sys.executable, "-m", "seqtrain.train.entry", "--config", str(bad)],
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 3
    assert "spec.replicas" in out.stderr and "Traceback" not in out.stderr
    wrong_world = subprocess.run([sys.executable, "-m", "seqtrain.train.entry", "--config",
                                  str(make_run(tmp_path, "world") / "trainer.json")],
                                 capture_output=True, text=True, timeout=DEADLINE_S, env={**os.environ, "WORLD_SIZE": "1"})
    assert wrong_world.returncode == 3 and "WORLD_SIZE=1" in wrong_world.stderr
    missing = subprocess.run([sys.executable, "-m", "seqtrain.train.entry", "--config", str(tmp_path / "nope.json")],
                             capture_output=True, text=True, timeout=DEADLINE_S)
    assert missing.returncode == 3 and "cannot read" in missing.stderr


def start_ranks_each_with_own_storage(tmp_path: Path, name: str,
                                      env: dict[str, str]) -> tuple[list[Path], list[int]]:
    """Two ranks whose run and checkpoint folders are each their own, as the pods of a Kubernetes job without
    checkpoint.pvc (every pod's emptyDir is its own), each with its own termination-message file; their exit codes."""
    job = resolve(load_job(TINY))
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launch.free_port()),
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", **env}
    folders, procs = [], []
    for rank in range(2):  # one rank per pod: the identity the manifests give it
        extra = {"RANK": str(rank), "LOCAL_RANK": "0", "NODE_RANK": str(rank)}
        pod = tmp_path / f"{name}-{extra['RANK']}"
        pod.mkdir()
        (pod / "termination-log").write_text("")
        write_trainer_config(str(pod / "trainer.json"), job,
                             RuntimeConfig(workdir=str(pod), checkpoint_dir=str(pod / "checkpoints")))
        with open(pod / "rank.log", "ab") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "seqtrain.train.entry", "--config",
                                           str(pod / "trainer.json")], stdout=log, stderr=subprocess.STDOUT,
                                          env={**base, **extra, "SEQTRAIN_TERMINATION_LOG": str(pod / "termination-log")}))
        folders.append(pod)
    return folders, wait_all(procs)


def test_ranks_without_shared_checkpoint_storage_train_on_without_checkpoints(tmp_path: Path, reference: Path) -> None:
    """Before: rank 1 crashed in the first save (the folder rank 0 created was not there for it), at every attempt.
    Now no rank crashes in a save: they say the folder is not shared, save nothing and train on; a rank killed later
    ends its peer with exit 4 (the echo of a peer's death) and the error line as the termination message."""
    from seqtrain_operator.k8s.pods.observe import failure_message

    (r0, r1), codes = start_ranks_each_with_own_storage(tmp_path, "killed", {"SEQTRAIN_FAULT_KILL_AT_STEP": "5:1"})
    rank_logs = (r0 / "rank.log").read_text() + (r1 / "rank.log").read_text()
    assert codes == [4, -signal.SIGKILL], rank_logs
    assert rank_logs.count("is not shared by every rank") == 2  # each rank says it once, at the first save (step 3)
    steps = [r["step"] for r in metrics(r0)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 4  # past the save of step 3 (the kill: 5)
    assert not list_checkpoints(str(r0 / "checkpoints")) and not (r1 / "checkpoints").exists()
    message = (r0 / "termination-log").read_text()
    # gloo says "closed" or "reset" by peer depending on which side of the socket noticed first
    assert message.startswith("seqtrain train: error: RuntimeError: ") and (
        "closed by peer" in message or "reset by peer" in message), message
    assert failure_message(message) == message.strip().removeprefix("seqtrain train: error: ")
    assert (r1 / "termination-log").read_text() == ""  # SIGKILLed: nothing written (the kubelet falls back to logs)
    # The restarted gang starts from scratch and runs to the end: exactly the shared-storage run's losses.
    (r0, r1), codes = start_ranks_each_with_own_storage(tmp_path, "again", {})
    assert codes == [0, 0], (r0 / "rank.log").read_text() + (r1 / "rank.log").read_text()
    assert [r["loss"] for r in metrics(r0)] == [r["loss"] for r in metrics(reference)]
