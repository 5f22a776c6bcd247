"""The per-pod rank launcher (`seqtrain train --nproc-per-node N`): which exit code a pod reports, which identity
each rank gets, and the process part with tiny fake ranks (`python -c` scripts, no torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from jobs import make_job
from seqtrain.runtime import launch as L
from seqtrain.spec import SeqTrainJob
from seqtrain_operator import cli
from seqtrain_operator.controller.failure_policy import FailureClass, classify
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.pods.observe import observe_replicas

TRAINER_ROOT = str(Path(L.__file__).resolve().parents[2])
DEADLINE_S = 30
OWNER = Owner(name="gpt", namespace="ml", uid="1234-abcd")
SETTINGS = m.Settings()
# Identity variables a developer's shell might hold; the tests give the launcher its environment explicitly.
IDENTITY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "SEQTRAIN_REPLICA", "MASTER_ADDR",
            "MASTER_PORT", "OMP_NUM_THREADS", L.GRACE_ENV)


def job(replicas: int, gpus: int) -> SeqTrainJob:
    return SeqTrainJob.model_validate(make_job("gpt", "ml", replicas=replicas,
                                               resources={"gpus": gpus, "cpu": "8", "memory": "64Gi"}))


def pod_of(replicas: int, gpus: int, replica: int) -> dict:
    return m.build_pod(job(replicas, gpus), OWNER, 1, replica, SETTINGS, "n1")


def pod_env(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}

# ---- which exit code -------------------------------------------------------------------------------------------

CODES = [  # (name, codes in the order the ranks ended, pod exit code)
    ("all ok", [0, 0, 0, 0], 0),
    ("crash, the others stopped by the launcher", [1, 143, 143], 1),
    ("invalid config wins over the crash before it", [1, 3, 143], 3),
    ("invalid config on every rank", [3, 3], 3),
    ("a SIGKILL before a collective timeout is the cause", [137, 4, 143], 137),
    ("a collective timeout first, the rest stopped by the launcher", [4, 143, 143], 4),
    ("invalid config wins over a collective timeout", [4, 3], 3),
    ("OOM-killed rank first", [137, 1], 137),
    ("no CUDA device (node fault) wins over the collective timeouts it causes", [4, 5, 143], 5),
    ("a full volume wins over the collective timeouts it causes", [4, 7, 143], 7),
    ("first failing rank, not the largest code", [2, 1], 2),
    ("finished ranks do not hide a later failure", [0, 0, 1], 1),
    ("pod stopped: ranks checkpointed and exited 143", [0, 143, 143], 143),
    ("no ranks", [], 0),
]


@pytest.mark.parametrize("codes,expected", [c[1:] for c in CODES], ids=[c[0] for c in CODES])
def test_replica_exit_code(codes, expected):
    assert L.replica_exit_code(codes) == expected


def test_signals_become_128_plus_n():
    assert [L.normalize(rc) for rc in (0, 3, -9, -15, -2)] == [0, 3, 137, 143, 130]


# ---- which identity --------------------------------------------------------------------------------------------


def test_ranks_of_a_pod_the_operator_builds():
    envs = L.rank_envs(4, {**pod_env(pod_of(replicas=3, gpus=4, replica=2)), "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("8", "0"), ("9", "1"), ("10", "2"), ("11", "3")]
    for e in envs:
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["NODE_RANK"]) == ("12", "4", "2")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("gpt-0.gpt.ml.svc", "29500")
        assert "CUDA_VISIBLE_DEVICES" not in e  # untouched: each rank takes cuda:LOCAL_RANK of what the pod sees


def test_the_pod_command_parses_with_the_real_cli():
    command = pod_of(replicas=2, gpus=2, replica=0)["spec"]["containers"][0]["command"]
    assert command[0] == "seqtrain"
    args = cli.build_parser().parse_args(command[1:])
    assert (args.config, args.nproc_per_node) == ("/etc/seqtrain/config.json", 2)
    assert cli.build_parser().parse_args(["train", "--config", "f.json"]).nproc_per_node == 1  # one rank: unchanged


@pytest.mark.parametrize("value", ["0", "two"])
def test_cli_rejects_a_bad_process_count(value, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["train", "--config", "f.json", "--nproc-per-node", value])
    assert exc.value.code == 2 and "--nproc-per-node" in capsys.readouterr().err


def test_a_pod_that_is_the_whole_job_rendezvous_on_loopback():
    envs = L.rank_envs(2, {"OMP_NUM_THREADS": "3"})
    assert [(e["RANK"], e["WORLD_SIZE"], e["NODE_RANK"]) for e in envs] == [("0", "2", "0"), ("1", "2", "0")]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and len({e["MASTER_PORT"] for e in envs}) == 1
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"3"}  # a value the user set is kept


def test_a_free_port_is_below_the_ephemeral_range_and_stays_free_of_bind_zero():
    """The rendezvous port comes from below the kernel's ephemeral range (only an explicit bind can take it before
    rank 0 listens: CI stop 45 lost a rank 0 to EADDRINUSE on a bind(0) port) and is bindable, with its span."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picks = {L.free_port(2) for _ in range(20)}
    assert len(picks) > 1  # random, not one fixed port two processes would both take
    for port in picks:
        assert port + 1 < low - 2000 and L.bindable(port) and L.bindable(port + 1)
    reserved = L.free_port(2, band=(2000, 0))  # the band kept for long-lived reservations
    assert low - 2000 <= reserved and reserved + 1 < low
    import socket

    with socket.socket() as s:  # a listener makes its port unbindable
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not L.bindable(s.getsockname()[1])


def test_node_rank_falls_back_to_the_replica_index():
    envs = L.rank_envs(2, {"WORLD_SIZE": "4", "SEQTRAIN_REPLICA": "1", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    assert [e["RANK"] for e in envs] == ["2", "3"]


BAD_ENV = [  # (env, nproc, words the message must contain)
    ({"WORLD_SIZE": "7", "NODE_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, 2, "WORLD_SIZE=7"),
    ({"WORLD_SIZE": "6", "NODE_RANK": "3", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, 2, "NODE_RANK=3"),
    ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3", "NODE_RANK": "0"}, 2, "LOCAL_WORLD_SIZE=3"),
    ({"WORLD_SIZE": "4", "NODE_RANK": "1", "MASTER_PORT": "1"}, 2, "MASTER_ADDR"),
    ({"WORLD_SIZE": "4", "NODE_RANK": "1", "MASTER_ADDR": "a"}, 2, "MASTER_PORT"),
    ({"WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, 2, "NODE_RANK"),
    ({"WORLD_SIZE": "four"}, 2, "WORLD_SIZE='four'"),
    ({}, 0, "--nproc-per-node=0"),
]


@pytest.mark.parametrize("environ,nproc,words", BAD_ENV, ids=[b[2] for b in BAD_ENV])
def test_a_bad_bootstrap_environment_names_the_variable(environ, nproc, words):
    with pytest.raises(L.LaunchError, match=words.replace("(", r"\(")):
        L.rank_envs(nproc, environ)


def test_cpu_budget_honours_the_cgroup_limit(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    f = tmp_path / "cpu.max"
    f.write_text("max 100000\n")
    assert L.cpu_budget(str(f)) == cpus
    f.write_text("50000 100000\n")  # half a CPU still gets one thread
    assert L.cpu_budget(str(f)) == 1
    assert L.cpu_budget(str(tmp_path / "absent")) == cpus


def test_term_grace_from_the_pod_env():
    assert L.term_grace_from({}) == L.DEFAULT_TERM_GRACE_SECONDS
    assert L.term_grace_from({L.GRACE_ENV: "115"}) == 115.0
    with pytest.raises(L.LaunchError, match=L.GRACE_ENV):
        L.term_grace_from({L.GRACE_ENV: "soon"})


# ---- what the operator makes of a multi-rank pod's exit ----------------------------------------------------------


@pytest.mark.parametrize("code,cls,reason", [(3, FailureClass.PERMANENT, "InvalidConfig"),
                                             (4, FailureClass.USER, "CollectiveTimeout"),
                                             (1, FailureClass.USER, "RankFailed")])
def test_a_multi_rank_pods_launcher_exit_is_classified_like_a_rank(code, cls, reason):
    # The container of a 4-rank pod ended with the launcher's code; FallbackToLogsOnError puts its last line in the
    # termination message.
    tail = f"seqtrain launch: exit codes of local ranks, in the order they ended: [{code}, 143, 143, 143]"
    p = pod_of(replicas=2, gpus=4, replica=1)
    p["spec"]["nodeName"] = "n1"
    p["status"] = {"phase": "Failed", "containerStatuses": [{"name": m.CONTAINER, "state": {"terminated": {
        "exitCode": code, "reason": "Error", "message": tail}}}]}
    n1 = {"metadata": {"name": "n1"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    (r,) = observe_replicas([p], [n1], datetime(2026, 11, 22, tzinfo=timezone.utc))
    failure = classify(r)
    assert (r.exit_code, failure.cls, failure.reason) == (code, cls, reason)
    assert f"[{code}, 143" in failure.message


# ---- the process part, with fake ranks ---------------------------------------------------------------------------

# A fake rank: records its environment, says it is ready, then acts out its part from FAKE_PLAN[LOCAL_RANK]:
# "ok" exit 0 | "exit:N" exit N | "die:SIG" kill itself | "wait" until a signal S, then exit 128+S |
# "wait:N" until SIGTERM, then exit N | "deaf" ignore SIGTERM/SIGINT. Exits only once every rank is ready, so a
# rank is never stopped before it installed its handlers.
FAKE = r"""
import json, os, signal, sys, time
out, local = os.environ["FAKE_OUT"], os.environ["LOCAL_RANK"]
plan = json.loads(os.environ["FAKE_PLAN"])[int(local)]
kind, _, arg = plan.partition(":")
def on_signal(signum, frame):
    open(os.path.join(out, f"signal-{local}"), "w").write(str(signum))
    os._exit(int(arg) if arg else 128 + signum)
if kind == "wait":
    signal.signal(signal.SIGTERM, on_signal); signal.signal(signal.SIGINT, on_signal)
if kind == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"]
info = {k: os.environ.get(k) for k in keys} | {"own_group": os.getpgid(0) == os.getpid()}
json.dump(info, open(os.path.join(out, f"env-{local}.json"), "w"))
open(os.path.join(out, f"ready-{local}"), "w").close()
n = int(os.environ["LOCAL_WORLD_SIZE"])
deadline = time.monotonic() + 30
while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"ready-{i}")) for i in range(n)):
    time.sleep(0.01)
if kind == "ok": sys.exit(0)
if kind == "exit": sys.exit(int(arg))
if kind == "die": os.kill(os.getpid(), int(arg))
time.sleep(60)
sys.exit(99)
"""
FAKE_CMD = [sys.executable, "-c", FAKE]


def fake_env(tmp_path: Path, plan: list[str], **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in IDENTITY}
    return {**base, "FAKE_OUT": str(tmp_path), "FAKE_PLAN": json.dumps(plan), **extra}


def signalled(tmp_path: Path, n: int) -> list[int | None]:
    files = [tmp_path / f"signal-{i}" for i in range(n)]
    return [int(f.read_text()) if f.exists() else None for f in files]


@pytest.mark.slow
def test_ranks_get_their_identity_and_all_ok_exits_0(tmp_path):
    env = fake_env(tmp_path, ["ok", "ok"], WORLD_SIZE="4", NODE_RANK="1", MASTER_ADDR="host-0.svc",
                   MASTER_PORT="29500", CUDA_VISIBLE_DEVICES="5,6")
    assert L.launch(FAKE_CMD, 2, env, term_grace=DEADLINE_S) == 0
    got = [json.loads((tmp_path / f"env-{i}.json").read_text()) for i in range(2)]
    assert [(g["RANK"], g["LOCAL_RANK"]) for g in got] == [("2", "0"), ("3", "1")]
    for g in got:
        assert (g["WORLD_SIZE"], g["LOCAL_WORLD_SIZE"], g["MASTER_ADDR"], g["MASTER_PORT"]) == \
            ("4", "2", "host-0.svc", "29500")
        assert g["CUDA_VISIBLE_DEVICES"] == "5,6" and g["own_group"] is True


FAILURES = [  # (plan per local rank, pod exit code, which ranks the launcher had to SIGTERM)
    (["wait", "exit:3", "wait"], 3, [signal.SIGTERM, None, signal.SIGTERM]),  # invalid config survives
    (["exit:1", "wait:4"], 1, [None, signal.SIGTERM]),  # a collective timeout after the crash is its echo: 1
    (["wait", "die:9"], 137, [signal.SIGTERM, None]),  # a rank killed (OOM): 128 + 9
    (["exit:2", "wait"], 2, [None, signal.SIGTERM]),
]


@pytest.mark.slow
@pytest.mark.parametrize("plan,code,stopped", FAILURES, ids=["invalid-config", "timeout-after-crash", "killed",
                                                             "crash"])
def test_one_failed_rank_stops_the_others_and_the_cause_is_the_replicas_code(tmp_path, plan, code, stopped, capsys):
    assert L.launch(FAKE_CMD, len(plan), fake_env(tmp_path, plan), failure_grace=DEADLINE_S) == code
    assert signalled(tmp_path, len(plan)) == stopped
    assert f"exiting {code}" in capsys.readouterr().err


@pytest.mark.slow
def test_a_rank_deaf_to_sigterm_is_killed_at_the_deadline_and_the_cause_is_kept(tmp_path, capsys):
    assert L.launch(FAKE_CMD, 2, fake_env(tmp_path, ["deaf", "exit:1"]), failure_grace=0.5) == 1
    err = capsys.readouterr().err
    assert "SIGKILL" in err and "[1, 137]" in err


@pytest.mark.slow
def test_a_bad_environment_starts_no_rank_and_exits_3(tmp_path, capsys):
    env = fake_env(tmp_path, ["ok", "ok"], WORLD_SIZE="3")
    assert L.launch(FAKE_CMD, 2, env) == 3
    assert not list(tmp_path.glob("env-*")) and "WORLD_SIZE=3" in capsys.readouterr().err


@pytest.mark.slow
def test_a_rank_that_cannot_start_fails_the_pod(tmp_path):
    assert L.launch([str(tmp_path / "no-such-program")], 2, fake_env(tmp_path, ["ok", "ok"])) == 1


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_reaches_every_rank(tmp_path, sig):
    driver = ("import sys; from seqtrain.runtime.launch import launch; "
              f"sys.exit(launch({FAKE_CMD!r}, 2, term_grace={DEADLINE_S}))")
    env = fake_env(tmp_path, ["wait", "wait"], PYTHONPATH=TRAINER_ROOT)
    launcher = subprocess.Popen([sys.executable, "-c", driver], env=env)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and launcher.poll() is None, "fake ranks never got ready"
            time.sleep(0.02)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=DEADLINE_S) == 128 + sig
    finally:
        launcher.kill()
    assert signalled(tmp_path, 2) == [sig, sig]


@pytest.mark.slow
def test_an_invalid_config_through_the_cli_exits_3(tmp_path, monkeypatch, capfd):
    """The issue itself: `seqtrain train --nproc-per-node 2` with a config no rank can read ends the pod with 3
    (torchrun made it 1, which the operator retried), with real `seqtrain train` ranks."""
    bad = tmp_path / "config.json"
    bad.write_text("not json")
    monkeypatch.setenv("PYTHONPATH", TRAINER_ROOT)
    for name in IDENTITY:
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["train", "--config", str(bad), "--nproc-per-node", "2"]) == 3
    err = capfd.readouterr().err
    # The first rank to fail says why; the other may be stopped (143) before it gets that far.
    assert "seqtrain train: invalid config" in err and "exiting 3" in err


def test_gpu_job_without_cuda_is_a_device_fault_not_an_invalid_config(monkeypatch):
    """Exit code 5 (the operator: infrastructure, avoid the node), not 3 (permanent)."""
    import torch

    from seqtrain.runtime import dist
    from seqtrain.runtime.exitcodes import DeviceUnavailable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NODE_NAME", "gpu-7")
    with pytest.raises(DeviceUnavailable, match="gpu-7"):
        dist.init_distributed(use_gpu=True)


@pytest.mark.slow
def test_a_failing_pods_termination_message_is_its_first_ranks_error_line(tmp_path, monkeypatch):
    """Both ranks of the pod fail; the container's termination-message file holds one error line, the first
    rank's, whatever the ranks printed after it (the operator reports it as the replica's reason)."""
    from seqtrain.runtime.exitcodes import ERROR_MARKER

    bad = tmp_path / "config.json"
    bad.write_text("not json")
    message = tmp_path / "termination-log"
    message.write_text("")  # the kubelet (or the test node agent) creates it empty
    monkeypatch.setenv("PYTHONPATH", TRAINER_ROOT)
    monkeypatch.setenv("SEQTRAIN_TERMINATION_LOG", str(message))
    for name in IDENTITY:
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["train", "--config", str(bad), "--nproc-per-node", "2"]) == 3
    lines = message.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{ERROR_MARKER}InvalidConfig: --config {bad}: not a trainer "
                                                   "config"), lines


def test_a_rank_whose_peer_died_exits_4_and_the_gang_reports_the_peer():
    """A gloo collective whose peer was killed ends with "Connection closed by peer": that rank exits 4 (the echo),
    so the operator reports the rank that died (here SIGKILLed), not the first replica by number."""
    from seqtrain.train.entry import is_comm_timeout, is_peer_gone
    from seqtrain_operator.controller.failure_policy import root_cause

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:15798. This is typically caused by a remote worker crashing.")
    assert is_peer_gone(gloo) and not is_comm_timeout(gloo)
    try:
        raise ValueError("step failed") from gloo
    except ValueError as chained:
        assert is_peer_gone(chained)
    assert not is_peer_gone(RuntimeError("Parent directory /x does not exist."))
    echo = {"exitCode": 4, "reason": "Error", "message": "seqtrain train: error: RuntimeError: Connection closed by peer"}
    died = {"exitCode": 137, "reason": "Error", "message": "seqtrain: fault injection: rank 1 kills itself after step 40"}
    pods = [{"metadata": {"labels": {"seqtrain.dev/replica": str(r), "seqtrain.dev/attempt": "1"}},
             "spec": {"nodeName": f"cpu-{r}"}, "status": {"phase": "Failed", "containerStatuses": [
                 {"name": "trainer", "state": {"terminated": term}}]}} for r, term in enumerate((echo, died))]
    nodes = [{"metadata": {"name": f"cpu-{r}"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
             for r in range(2)]
    cause = root_cause(observe_replicas(pods, nodes, datetime.now(timezone.utc)))
    assert cause is not None and cause.replica == 1
    assert cause.message == ("replica 1 on cpu-1 failed (RankFailed, exit code 137 (killed by SIGKILL)): "
                             "seqtrain: fault injection: rank 1 kills itself after step 40")
