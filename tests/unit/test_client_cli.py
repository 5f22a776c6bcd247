"""The cluster commands' arguments, exit codes and one-line errors, `prepare` and `wait_for`, and the local
backend's reading side (list, status, logs, wait on run folders laid out as `seqtrain run` lays them out).
The real cluster is tests/integration/test_client_real.py's."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import yaml

from seqtrain_operator.cli import _duration, build_parser, main
from seqtrain_operator.client import Client, InvalidJob, JobEnded, WaitTimeout, prepare
from seqtrain_operator.client.api import phases_of, wait_for
from seqtrain_operator.client.model import Job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "k8s-cpu.yaml"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---- arguments ------------------------------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    from seqtrain import __version__

    assert capsys.readouterr().out.strip() == f"seqtrain {__version__}"


def test_cluster_options_parse_like_kubectls() -> None:
    a = build_parser().parse_args(["logs", "job", "-f", "--rank", "3", "-n", "team", "--context", "prod",
                                   "--attempt", "2"])
    assert (a.job, a.follow, a.rank, a.all, a.namespace, a.context, a.attempt) == ("job", True, 3, False, "team",
                                                                                  "prod", 2)
    a = build_parser().parse_args(["wait", "job", "--for", "Running", "--for", "Failed", "--timeout", "10m"])
    assert a.phase == ["Running", "Failed"] and a.timeout == 600.0
    assert build_parser().parse_args(["list", "-A"]).all_namespaces
    a = build_parser().parse_args(["submit", "f.yaml", "--set", "training.steps=5", "--name", "x", "--wait"])
    assert (a.file, a.set, a.name, a.wait) == ("f.yaml", ["training.steps=5"], "x", True)


@pytest.mark.parametrize("argv", [
    ["logs", "j", "--rank", "1", "--all"], ["logs", "j", "--attempt", "1", "--previous"], ["logs", "j", "--attempt", "0"],
    ["wait", "j", "--timeout", "soon"], ["delete"], ["status"],
])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(("text", "seconds"), [("30", 30.0), ("30s", 30.0), ("1.5m", 90.0), ("2h", 7200.0)])
def test_durations(text: str, seconds: float) -> None:
    assert _duration(text) == seconds


# ---- errors before and without a cluster ----------------------------------------------------------------------


def test_an_invalid_job_exits_2_before_the_cluster_is_asked(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")  # a cluster call would fail with exit 1
    rc, _, err = run_cli(capsys, "submit", str(EXAMPLE), "--set", "training.steps=0", "--set", "replicas=x")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{EXAMPLE}: spec.") for line in lines)


def test_no_kubeconfig_is_one_line_with_the_fix(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    rc, out, err = run_cli(capsys, "list")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert "no kubeconfig at /nonexistent/kubeconfig" in err and "KUBECONFIG" in err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_cluster_is_one_line_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    kc = tmp_path / "kubeconfig"
    kc.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "dead",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{_closed_port()}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "dead", "context": {"cluster": "c", "user": "u", "namespace": "team"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kc))
    rc, _, err = run_cli(capsys, "status", "demo")
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "cannot reach the cluster at https://127.0.0.1:" in err and "--context" in err
    rc, _, err = run_cli(capsys, "status", "demo", "--context", "prod")
    assert rc == 1 and "--context prod: not in" in err and "dead" in err


# ---- prepare and wait_for -------------------------------------------------------------------------------------


def test_prepare_applies_name_namespace_and_overrides_to_the_users_document() -> None:
    doc = prepare(EXAMPLE, ["training.steps=7"], name="other", namespace="team")
    assert doc["metadata"] == {"name": "other", "namespace": "team"}
    assert doc["spec"]["training"]["steps"] == 7
    assert "seqLen" in doc["spec"]["data"] and "optimizer" not in doc["spec"]["training"]  # as written, not resolved


def test_prepare_refuses_what_validate_refuses(tmp_path: Path) -> None:
    two = tmp_path / "two.yaml"
    two.write_text(EXAMPLE.read_text() + "\n---\n" + EXAMPLE.read_text())
    with pytest.raises(InvalidJob, match="exactly one SeqTrainJob"):
        prepare(two)
    with pytest.raises(InvalidJob) as bad:
        prepare({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "Bad_Name"}})
    assert bad.value.exit_code == 2 and any(p.startswith("metadata.name") for p in bad.value.problems)
    with pytest.raises(InvalidJob, match="cannot read"):
        prepare(tmp_path / "missing.yaml")


def _job(phase: str) -> Job:
    from seqtrain.spec.status import JobStatus

    return Job(name="j", namespace="ns", status=JobStatus(phase=phase))  # type: ignore[arg-type]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_wait_for_returns_the_phase_reached_or_says_how_it_ended() -> None:
    seq = iter(["Pending", "Running", "Restarting", "Running", "Succeeded"])
    clock = FakeClock()
    assert wait_for(lambda n: _job(next(seq)), "j", ("Succeeded",), None, 1.0, clock.sleep, clock).phase == "Succeeded"
    assert clock.t == 4.0
    seq = iter(["Running", "Failed"])
    with pytest.raises(JobEnded) as ended:
        wait_for(lambda n: _job(next(seq)), "j", ("Succeeded",), None, 1.0, clock.sleep, clock)
    assert ended.value.exit_code == 1 and "ended Failed" in str(ended.value)


def test_wait_for_times_out_with_exit_124() -> None:
    clock = FakeClock()
    with pytest.raises(WaitTimeout) as late:
        wait_for(lambda n: _job("Running"), "j", ("Succeeded",), 2.5, 1.0, clock.sleep, clock)
    assert late.value.exit_code == 124 and clock.t == 2.5 and "still Running after 2.5s" in str(late.value)


def test_phases_are_checked() -> None:
    assert phases_of("Running") == ("Running",)
    with pytest.raises(InvalidJob, match="Runing: not a phase"):
        phases_of(["Runing"])


# ---- the local backend's reading side, on a run folder as `seqtrain run` writes it -----------------------------


def _run_folder(root: Path, name: str, phase: str, attempt: int = 2) -> Path:
    wd = root / name
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    (wd / "attempts" / "1").mkdir(parents=True)
    (wd / "attempts" / str(attempt)).mkdir(parents=True, exist_ok=True)
    (wd / "submitted.yaml").write_text(yaml.safe_dump(doc))
    status = {"phase": phase, "attempt": attempt, "restarts": attempt - 1, "worldSize": 2, "replicas": 2,
              "progress": {"step": 30, "totalSteps": 60, "loss": 3.5}}
    (wd / "status.json").write_text(json.dumps(status))
    for a in (1, attempt):
        for r in (0, 1):
            (wd / "attempts" / str(a) / f"rank-{r}.log").write_text(f"attempt {a} rank {r} line 1\nline 2\n")
    (wd / "events.jsonl").write_text(json.dumps({"time": "2026-01-02T11:58:40Z", "type": "Warning",
                                                 "reason": "ReplicaFailed", "message": "replica 1 exited 1; "
                                                 "restart 1/3 in 2s from checkpoint step 20"}) + "\n")
    return wd


def test_local_list_status_logs_and_wait_read_run_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_folder(tmp_path, "alpha", "Succeeded")
    _run_folder(tmp_path, "beta", "Running")
    loc = ["--local", "--runs-dir", str(tmp_path)]
    rc, out, _ = run_cli(capsys, "list", *loc)
    rows = [line.split() for line in out.splitlines()]
    assert rc == 0 and [r[:4] for r in rows[1:]] == [["alpha", "Succeeded", "30/60", "3.5000"],
                                                      ["beta", "Running", "30/60", "3.5000"]]
    rc, out, _ = run_cli(capsys, "status", "beta", *loc)
    assert rc == 0 and "ReplicaFailed: replica 1 exited 1" in out and f"run folder {tmp_path / 'beta'}" in out
    rc, out, _ = run_cli(capsys, "logs", "alpha", *loc)
    assert out.splitlines() == ["[rank 0] attempt 2 rank 0 line 1", "[rank 0] line 2"]
    rc, out, _ = run_cli(capsys, "logs", "alpha", "--all", "--previous", *loc)
    assert sorted(out.splitlines()) == ["[rank 0] attempt 1 rank 0 line 1", "[rank 0] line 2",
                                        "[rank 1] attempt 1 rank 1 line 1", "[rank 1] line 2"]
    rc, out, _ = run_cli(capsys, "logs", "alpha", "-f", "--rank", "1", *loc)  # ended: -f returns at the end
    assert rc == 0 and out.splitlines() == ["[rank 1] attempt 2 rank 1 line 1", "[rank 1] line 2"]
    assert run_cli(capsys, "wait", "alpha", *loc)[0] == 0
    rc, _, err = run_cli(capsys, "wait", "alpha", "--for", "Failed", *loc)
    assert rc == 1 and "alpha: Succeeded at step 30/60" in err
    rc, _, err = run_cli(capsys, "wait", "beta", "--timeout", "0.3", *loc)
    assert rc == 124 and "still Running after 0.3s" in err
    rc, _, err = run_cli(capsys, "status", "gamma", *loc)
    assert rc == 1 and err.count("\n") == 1 and "gamma" in err


def test_local_client_sees_a_dead_runner_as_suspended(tmp_path: Path) -> None:
    wd = _run_folder(tmp_path, "beta", "Running")
    (wd / "runner.pid").write_text(f"{2**22 + 12345}\n")  # above pid_max's default range: no such process
    job = Client(local=True, runs_dir=str(tmp_path)).get("beta")
    assert job.phase == "Suspended" and "seqtrain resume beta" in job.status.message
    assert os.path.isdir(job.workdir or "")
