"""In-place restarts (seqtrain.runtime.restart): the coordinator's barrier as a pure state machine, the settings the
launchers read, and real launcher processes (one per replica, as in pods) restarting tiny fake ranks in place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seqtrain.runtime import faults
from seqtrain.runtime import launch as L
from seqtrain.runtime import restart as R
from seqtrain.spec import SeqTrainJob
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m

TRAINER_ROOT = str(Path(L.__file__).resolve().parents[2])
DEADLINE_S = 60


def plan(delays: tuple[float, ...] = (0.0, 0.0), replicas: int = 2, barrier: float = 5.0) -> R.InPlace:
    return R.InPlace(delays=delays, port=1, barrier_seconds=barrier, replicas=replicas)


def barrier(*connected: int, **kw: object) -> R.Barrier:
    b = R.Barrier(plan(**kw))  # type: ignore[arg-type]
    for n in connected:
        b.join(n)
    return b


# ---- the barrier -------------------------------------------------------------------------------------------------


def test_a_failure_opens_a_round_and_all_ready_lets_it_go() -> None:
    b = barrier(0, 1)
    (msg,) = b.fail(1, 0, 137, now=0.0)
    assert msg["restart"] == 1 and msg["code"] == 137 and msg["notBefore"] > 0
    assert b.fail(0, 0, 4, now=0.1) == []  # the peer's echo of the same failure: one round, not two
    assert b.ready(1, 1) == []
    assert b.ready(0, 1) == [{"go": 1}]
    assert b.round == 1 and b.deadline is None


def test_a_failure_in_the_restarted_round_opens_the_next_one_until_none_is_left() -> None:
    b = barrier(0, 1, delays=(0.0,))
    b.fail(0, 0, 1, now=0.0)
    b.ready(0, 1)
    b.ready(1, 1)
    assert b.fail(1, 0, 1, now=1.0) == []  # a stale report of round 0
    (msg,) = b.fail(1, 1, 1, now=1.0)
    assert msg["abort"] == 1 and msg["code"] == 1 and "used up" in msg["why"]


def test_a_launcher_that_misses_the_barrier_deadline_aborts_the_round() -> None:
    b = barrier(0, 1, barrier=5.0)
    b.fail(0, 0, 1, now=10.0)
    b.ready(0, 1)
    assert b.tick(14.9) == []
    (msg,) = b.tick(15.0)
    assert msg["abort"] == 1 and "replica(s) [1]" in msg["why"] and b.ready(1, 1) == []


def test_a_launcher_that_leaves_during_a_round_aborts_it_at_once() -> None:
    b = barrier(0, 1)
    b.fail(0, 0, 1, now=0.0)
    (msg,) = b.leave(1, now=0.5)
    assert msg["abort"] == 1 and "disconnected" in msg["why"]


def test_no_round_opens_once_a_launcher_disconnected() -> None:
    b = barrier(0, 1)
    b.leave(1, now=0.0)  # its pod is gone; nothing runs a barrier yet
    (msg,) = b.fail(0, 0, 4, now=1.0)
    assert "abort" in msg and "[1]" in msg["why"]


def test_a_launcher_that_connects_during_a_round_gets_its_order() -> None:
    b = barrier(0)  # replica 1's launcher has not connected yet (its pod started later)
    (msg,) = b.fail(0, 0, 1, now=0.0)
    assert b.join(1) == [msg]
    b.ready(0, 1)
    assert b.ready(1, 1) == [{"go": 1}]


# ---- settings --------------------------------------------------------------------------------------------------


def test_settings_from_the_environment() -> None:
    got = R.in_place_from({"SEQTRAIN_INPLACE_DELAYS": "2,4.5", "MASTER_PORT": "29500"}, 3)
    assert got == R.InPlace((2.0, 4.5), 29501, R.DEFAULT_BARRIER_SECONDS, 3) and got.enabled
    assert not R.in_place_from({}, 2).enabled


@pytest.mark.parametrize("environ,words", [
    ({"SEQTRAIN_INPLACE_DELAYS": "2,x", "MASTER_PORT": "1"}, "SEQTRAIN_INPLACE_DELAYS"),
    ({"SEQTRAIN_INPLACE_DELAYS": "-1", "MASTER_PORT": "1"}, ">= 0"),
    ({"SEQTRAIN_INPLACE_DELAYS": "1"}, "SEQTRAIN_RESTART_PORT"),
    ({"SEQTRAIN_INPLACE_DELAYS": "1", "SEQTRAIN_RESTART_PORT": "70000"}, "TCP port"),
])
def test_bad_settings_name_the_variable(environ: dict[str, str], words: str) -> None:
    with pytest.raises(R.RestartConfigError, match=words):
        R.in_place_from(environ, 2)


@pytest.mark.parametrize("code,ok", [(0, False), (3, False), (5, False), (1, True), (4, True), (6, True),
                                     (137, True), (143, True)])
def test_which_rank_exits_restart_in_place(code: int, ok: bool) -> None:
    assert R.restartable(code) is ok


def test_the_launchers_exit_report_is_read_back() -> None:
    assert R.rounds_in(f"seqtrain train: error: X\n{R.ROUNDS_MARKER}2\n") == 2
    assert R.rounds_in("nothing here") == 0 and R.rounds_in(None) == 0


def test_a_fault_armed_for_an_attempt_fires_in_its_first_round_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEQTRAIN_ATTEMPT", "1")
    monkeypatch.setenv("SEQTRAIN_FAULT_ATTEMPT", "1")
    monkeypatch.delenv("SEQTRAIN_RESTART_ROUND", raising=False)
    assert faults._armed()
    monkeypatch.setenv("SEQTRAIN_RESTART_ROUND", "1")
    assert not faults._armed()
    monkeypatch.setenv("SEQTRAIN_FAULT_ATTEMPT", "1.1")
    assert faults._armed()


def test_pods_carry_the_in_place_settings_only_when_the_core_hands_them_out() -> None:
    job = SeqTrainJob.model_validate({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob",
                                      "metadata": {"name": "gpt", "namespace": "ml"}, "spec": {"replicas": 2}})
    owner, settings = Owner(name="gpt", namespace="ml", uid="u"), m.Settings()

    def env(pod: dict) -> dict[str, str]:
        return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}

    on = m.build_pod(job, owner, 1, 1, settings, None, (2.0, 4.0))
    assert env(on)["SEQTRAIN_INPLACE_DELAYS"] == "2,4"
    assert env(on)["SEQTRAIN_RESTART_PORT"] == str(settings.master_port + 1)
    assert {"name": "restart", "containerPort": settings.master_port + 1, "protocol": "TCP"} in \
        on["spec"]["containers"][0]["ports"]
    assert "SEQTRAIN_INPLACE_DELAYS" not in env(m.build_pod(job, owner, 1, 1, settings, None))


# ---- real launchers, fake ranks ----------------------------------------------------------------------------------

# A fake rank: records that it started (rank, round, pid), then does what FAKE_PLAN["<rank>:<round>"] says (default
# "ok"): "ok" exit 0 | "exit:N" exit N | "wait" until SIGTERM (exit 143) | "fail-when:NAME" exit 1 once FAKE_OUT/NAME
# exists | "early:N" exit N before its first step (every other plan marks a step done, as the trainer does).
FAKE = r"""
import json, os, signal, sys, time
out, rank = os.environ["FAKE_OUT"], os.environ["RANK"]
rnd = os.environ.get("SEQTRAIN_RESTART_ROUND", "?")
open(os.path.join(out, f"start-{rank}-{rnd}-{os.getpid()}"), "w").close()
act = json.loads(os.environ["FAKE_PLAN"]).get(f"{rank}:{rnd}", "ok")
kind, _, arg = act.partition(":")
signal.signal(signal.SIGTERM, lambda s, f: os._exit(143))
n = int(os.environ["WORLD_SIZE"])  # act once every rank of this round started (none is stopped before it did)
until = time.monotonic() + 30
while time.monotonic() < until and len({f.split("-")[1] for f in os.listdir(out)
                                        if f.startswith("start-") and f.split("-")[2] == rnd}) < n:
    time.sleep(0.01)
if kind == "early": sys.exit(int(arg))
if os.environ.get("SEQTRAIN_STEPPED_FILE"): open(os.environ["SEQTRAIN_STEPPED_FILE"], "a").close()
if kind == "exit": sys.exit(int(arg))
deadline = time.monotonic() + 60
while kind in ("wait", "fail-when") and time.monotonic() < deadline:
    if kind == "fail-when" and os.path.exists(os.path.join(out, arg)): sys.exit(1)
    time.sleep(0.02)
sys.exit(0 if kind == "ok" else 99)
"""


def gang(tmp_path: Path, fake_plan: dict[str, str], delays: str, replicas: int = 2,
         barrier: float = 10.0) -> list[subprocess.Popen]:
    """One launcher process per replica (what each pod runs), one fake rank each."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SEQTRAIN_", "RANK", "LOCAL_", "NODE_RANK",
                                                                        "WORLD_SIZE", "MASTER_"))}
    env = {**keep, "PYTHONPATH": TRAINER_ROOT, "FAKE_OUT": str(tmp_path), "FAKE_PLAN": json.dumps(fake_plan),
           "WORLD_SIZE": str(replicas), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(L.free_port()),
           "SEQTRAIN_RESTART_PORT": str(L.free_port()), "SEQTRAIN_INPLACE_DELAYS": delays,
           "SEQTRAIN_RESTART_BARRIER_SECONDS": str(barrier)}
    return [subprocess.Popen([sys.executable, "-m", "seqtrain.runtime.launch", "--nproc-per-node=1", "--",
                              sys.executable, "-c", FAKE], env={**env, "NODE_RANK": str(r)},
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
            for r in range(replicas)]


def ends(launchers: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    for p in launchers:
        try:
            _, err = p.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            for q in launchers:
                q.kill()
            pytest.fail(f"launcher {p.args} did not end within {DEADLINE_S}s")
        out.append((p.returncode, err))
    return out


def starts(tmp_path: Path) -> list[tuple[int, int]]:
    """(rank, round) of every rank process started, in order of rank then round."""
    got = [f.name.split("-")[1:3] for f in tmp_path.glob("start-*")]
    return sorted((int(r), int(n)) for r, n in got)


@pytest.mark.slow
def test_a_failed_rank_restarts_every_replicas_ranks_in_place_and_the_launchers_survive(tmp_path: Path) -> None:
    launchers = gang(tmp_path, {"0:0": "wait", "1:0": "exit:1"}, delays="0,0")
    results = ends(launchers)
    assert [code for code, _ in results] == [0, 0], results
    assert starts(tmp_path) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # each rank twice, the launchers once
    assert "another replica failed (in-place restart 1)" in results[0][1]
    assert "in-place restart 1: starting 1 local rank(s) again" in results[1][1]


@pytest.mark.slow
def test_when_the_in_place_restarts_are_used_up_every_launcher_exits_with_the_cause(tmp_path: Path) -> None:
    launchers = gang(tmp_path, {"0:0": "wait", "0:1": "wait", "1:0": "exit:1", "1:1": "exit:7"}, delays="0")
    results = ends(launchers)
    assert [code for code, _ in results] == [7, 7], results  # replica 0 reports the cause, not its SIGTERMed rank
    assert all(f"{R.ROUNDS_MARKER}1" in err for _, err in results)
    assert starts(tmp_path) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.slow
def test_an_invalid_config_is_never_restarted_in_place(tmp_path: Path) -> None:
    launchers = gang(tmp_path, {"0:0": "wait", "1:0": "exit:3"}, delays="0,0")
    assert ends(launchers[1:])[0][0] == 3
    assert launchers[0].poll() is None  # never told to restart: it runs on until the operator deletes the gang
    launchers[0].send_signal(signal.SIGTERM)  # ... as it does now: a stop is not a failure to restart from
    assert ends(launchers[:1])[0][0] == 143
    assert starts(tmp_path) == [(0, 0), (1, 0)]


@pytest.mark.slow
def test_a_lost_replica_makes_the_others_fall_back_to_re_creation(tmp_path: Path) -> None:
    launchers = gang(tmp_path, {"0:0": "fail-when:lost", "1:0": "wait"}, delays="0,0")
    deadline = time.monotonic() + DEADLINE_S
    while len(starts(tmp_path)) < 2:
        assert time.monotonic() < deadline, "ranks never started"
        time.sleep(0.02)
    rank1 = int(next(tmp_path.glob("start-1-0-*")).name.rsplit("-", 1)[1])
    os.killpg(launchers[1].pid, signal.SIGKILL)  # its pod is gone: launcher and rank die without a word
    os.killpg(rank1, signal.SIGKILL)
    (tmp_path / "lost").touch()  # rank 0's collective fails because its peer vanished
    code, err = ends(launchers[:1])[0]
    launchers[1].wait(timeout=DEADLINE_S)
    # at once when its connection was seen to drop, else at the barrier's deadline
    assert code == 1 and "no in-place restart" in err and ("disconnected" in err or "did not reach" in err), err
    assert starts(tmp_path) == [(0, 0), (1, 0)]  # nothing restarted in place


@pytest.mark.slow
def test_a_failure_before_the_first_step_is_left_to_the_operator(tmp_path: Path) -> None:
    launchers = gang(tmp_path, {"0:0": "wait", "1:0": "early:1"}, delays="0,0")
    code, err = ends(launchers[1:])[0]
    assert code == 1 and "before its first step" in err
    launchers[0].send_signal(signal.SIGTERM)
    ends(launchers[:1])
    assert starts(tmp_path) == [(0, 0), (1, 0)]


@pytest.mark.slow
def test_a_rank_dies_with_its_launcher(tmp_path: Path) -> None:
    # The launcher (a pod's main process) is SIGKILLed alone, as the test node agent does when a node dies: the
    # rank, in a session of its own, must not train on as an orphan.
    rank = ("import time; from seqtrain.runtime.restart import die_with_launcher; die_with_launcher(); "
            "open(__import__('os').environ['FAKE_OUT'] + '/up', 'w').close(); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": TRAINER_ROOT, "FAKE_OUT": str(tmp_path)}
    for k in ("WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "SEQTRAIN_INPLACE_DELAYS"):
        env.pop(k, None)
    launcher = subprocess.Popen([sys.executable, "-m", "seqtrain.runtime.launch", "--nproc-per-node=1", "--",
                                 sys.executable, "-c", rank], env=env)
    deadline = time.monotonic() + DEADLINE_S
    while not (tmp_path / "up").exists():
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.02)
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    launcher.kill()
    launcher.wait()
    for pid in map(int, children):
        while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]:
            assert time.monotonic() < deadline, "the rank outlived its launcher"
            time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("order", ['{"SEQTRAIN_RESTART_ROUND": "2"}\n', ""], ids=["released", "dropped"])
def test_a_spare_rank_waits_for_its_order_after_its_imports(order: str) -> None:
    # What a spare rank does between its imports and its start (seqtrain.train.entry): wait on the launcher's pipe.
    code = ("import os; from seqtrain.runtime.restart import await_start; await_start(); "
            "print(os.environ['SEQTRAIN_RESTART_ROUND'], 'SEQTRAIN_STANDBY_FD' in os.environ)")
    read, write = os.pipe()
    env = {**os.environ, "PYTHONPATH": TRAINER_ROOT, R.STANDBY_ENV: str(read), R.ROUND_ENV: "?"}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, pass_fds=(read,), stdout=subprocess.PIPE,
                             text=True)
    os.close(read)
    os.write(write, order.encode())
    os.close(write)
    out, _ = child.communicate(timeout=DEADLINE_S)
    assert child.returncode == 0
    assert out.split() == (["2", "False"] if order else [])  # dropped: it ends without starting


# A fake rank that honours the spare protocol as the trainer does: a spare records its start, waits for its order
# (await_start), then runs as the round it was given. Round 0 steps, then fails once the spare has started.
FAKE_WITH_SPARES = r"""
import os, sys, time
from seqtrain.runtime import restart
out = os.environ["FAKE_OUT"]
if os.environ.get(restart.STANDBY_ENV):
    open(os.path.join(out, f"spare-{os.getpid()}-{time.time():.6f}"), "w").close()
    restart.await_start()
rnd = os.environ[restart.ROUND_ENV]
open(os.path.join(out, f"round-{rnd}-{os.getpid()}"), "w").close()
if rnd != "0":
    sys.exit(0)
time.sleep(0.5)  # start-up: no spare may start meanwhile
open(os.path.join(out, f"stepped-{time.time():.6f}"), "w").close()
restart.mark_stepped()
deadline = time.monotonic() + 30
while not any(f.startswith("spare-") for f in os.listdir(out)) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(1)
"""


@pytest.mark.slow
def test_spare_ranks_start_after_the_rounds_first_step_and_become_the_next_round(tmp_path: Path) -> None:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SEQTRAIN_", "RANK", "LOCAL_", "NODE_RANK",
                                                                        "WORLD_SIZE", "MASTER_"))}
    env = {**keep, "PYTHONPATH": TRAINER_ROOT, "FAKE_OUT": str(tmp_path), "WORLD_SIZE": "1", "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(L.free_port()), "SEQTRAIN_RESTART_PORT": str(L.free_port()),
           "SEQTRAIN_INPLACE_DELAYS": "0"}
    code = (f"import sys; from seqtrain.runtime.launch import launch; "
            f"sys.exit(launch([sys.executable, '-c', {FAKE_WITH_SPARES!r}], 1, standby=True))")
    launcher = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=DEADLINE_S)
    assert launcher.returncode == 0, launcher.stderr
    names = [f.name for f in tmp_path.iterdir()]
    (stepped,) = [float(n.split("-")[1]) for n in names if n.startswith("stepped-")]
    spares = {n.split("-")[1]: float(n.split("-")[2]) for n in names if n.startswith("spare-")}
    assert spares and min(spares.values()) > stepped  # none started while round 0 was starting
    (round1,) = [n.split("-")[2] for n in names if n.startswith("round-1-")]
    assert round1 in spares  # the restart used the spare, not a new process
    assert "in-place restart 1: starting 1 local rank(s) again" in launcher.stderr


def test_the_backoff_wait_ends_at_a_sigterm() -> None:
    # A pod's grace period may be shorter than the backoff left: a SIGTERM (stop() true) ends the wait at once.
    asked = []
    R.wait_not_before({R.NOT_BEFORE_ENV: f"{time.time() + 3600:.3f}"}, stop=lambda: asked.append(1) or len(asked) > 2)
    assert len(asked) == 3
