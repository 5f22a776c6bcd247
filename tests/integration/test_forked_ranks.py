"""The harness's forked ranks (seqtrain.parallel.forked, on in the suite) are the ranks an exec starts: the same
losses to the bit, exit codes and signals by pid as Popen gives them, and a rank whose import-time environment
differs from the server's is executed instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import make_job
from seqtrain.parallel import forked, launch
from seqtrain.spec import RuntimeConfig, SeqTrainJob, resolve, write_trainer_config

pytestmark = pytest.mark.slow

DEADLINE_S = 180


def config(workdir: Path, steps: int) -> Path:
    workdir.mkdir(parents=True)
    job = resolve(SeqTrainJob.model_validate(make_job(
        "forked", replicas=2, model={"arch": "gpt", "preset": "tiny"}, data={"source": "builtin", "seqLen": 32},
        training={"steps": steps, "globalBatchSize": 8, "microBatchSize": 2, "optimizer": {"lr": 0.003}})))
    path = workdir / "trainer.json"
    write_trainer_config(str(path), job, RuntimeConfig(workdir=str(workdir), checkpoint_dir=str(workdir / "ck")))
    return path


def losses(workdir: Path) -> list[float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r and r.get("kind", "train") == "train"]


def logs(workdir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(workdir.glob("rank*.log")))


def test_a_forked_gang_trains_to_the_bit_as_an_executed_one(tmp_path: Path) -> None:
    got = {}
    for fork in ("1", "0"):
        wd = tmp_path / f"fork{fork}"
        procs = launch.start_ranks(config(wd, 4), wd, 2, {forked.ENV: fork})
        assert [isinstance(p, forked.ForkedRank) for p in procs] == [fork == "1"] * 2
        assert launch.wait_ranks(procs, DEADLINE_S) == [0, 0], logs(wd)
        got[fork] = losses(wd)
    assert len(got["1"]) == 4 and got["1"] == got["0"], got


def test_a_forked_rank_takes_signals_by_its_pid_and_reports_them_as_popen_does(tmp_path: Path) -> None:
    wd = tmp_path / "signals"
    procs = launch.start_ranks(config(wd, 100000), wd, 2, {forked.ENV: "1"})
    try:
        assert all(isinstance(p, forked.ForkedRank) for p in procs)
        assert procs[0].pid != procs[1].pid and os.getpid() not in (procs[0].pid, procs[1].pid)
        end = time.monotonic() + DEADLINE_S
        while not (wd / "metrics.jsonl").exists():  # training: both ranks are past their start
            assert time.monotonic() < end and all(p.poll() is None for p in procs), logs(wd)
            time.sleep(0.2)
        with pytest.raises(subprocess.TimeoutExpired):
            procs[0].wait(timeout=0.2)
        os.kill(procs[1].pid, signal.SIGSTOP)  # by pid, as test_collective_timeout does
        while not Path(f"/proc/{procs[1].pid}/stat").read_text().split(") ")[1].startswith("T"):  # stopped
            assert time.monotonic() < end, "SIGSTOP did not stop the forked rank"
            time.sleep(0.05)
        # Rank 0 first: with its peer gone it would end by itself (exit 4, a broken collective). Rank 1 is stopped
        # and cannot end but by the signal.
        procs[0].kill()
        assert procs[0].wait(timeout=60) == -signal.SIGKILL and procs[0].returncode == -signal.SIGKILL
        procs[1].kill()
        assert procs[1].wait(timeout=60) == -signal.SIGKILL
        procs[1].kill()  # already gone: nothing to signal, no error
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)


def test_a_rank_whose_import_time_environment_differs_is_executed(tmp_path: Path) -> None:
    wd = tmp_path / "executed"
    with pytest.warns(UserWarning, match="executing ranks whose PYTHONHASHSEED differ"):  # a slower suite says why
        procs = launch.start_ranks(config(wd, 2), wd, 2, {forked.ENV: "1", "PYTHONHASHSEED": "7"})
    assert [type(p) for p in procs] == [subprocess.Popen] * 2
    assert launch.wait_ranks(procs, DEADLINE_S) == [0, 0], logs(wd)


def test_the_server_imports_none_of_what_a_rank_may_need_set_up_first() -> None:
    """TRITON_INTERPRET decides how seqtrain's kernels (`seqtrain.kernels.ops`, the @triton.jit modules) load,
    DS_ACCELERATOR how DeepSpeed does: neither is imported by the server, so each rank imports them with its own
    environment."""
    code = ("import importlib, json, sys; from seqtrain.parallel import forked\n"
            "[importlib.import_module(m) for m in forked.PRELOAD]\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'transformers')"
            " or m.startswith('seqtrain.kernels.ops'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout) == [], out.stdout
