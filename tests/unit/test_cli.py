"""CLI argument handling for validate / crd / run (in-process, no rank is started)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from seqtrain_operator import cli

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def test_validate_good_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(QUICKSTART)]) == 0
    assert "valid (quickstart)" in capsys.readouterr().out


def test_validate_reports_every_problem_with_file_and_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    text = re.sub(r"\n    steps: (\d+)", r"\n    stepz: \1", QUICKSTART.read_text(), count=1)
    assert "stepz:" in text
    bad.write_text(text.replace("replicas: 2", "replicas: -1"))
    assert cli.main(["validate", str(QUICKSTART), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(line.startswith(f"{bad}: spec.replicas:") for line in err), err
    assert any(line.startswith(f"{bad}: spec.training.stepz: unknown field; did you mean 'steps'?") for line in err)
    assert not any(str(QUICKSTART) in line for line in err)


def test_validate_unreadable_and_malformed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    assert cli.main(["validate", str(tmp_path / "nope.yaml"), str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nope.yaml'}: <file>: cannot read" in err
    assert f"{broken}: <yaml>: line" in err and "Traceback" not in err


def test_validate_set_override_is_validated(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(QUICKSTART), "--set", "training.steps=0"]) == 2
    assert "spec.training.steps" in capsys.readouterr().err
    assert cli.main(["validate", str(QUICKSTART), "--set", "training.steps"]) == 2
    assert "--set: 'training.steps' must look like path.to.field=VALUE" in capsys.readouterr().err


@pytest.mark.slow
def test_a_reader_that_goes_away_gets_no_traceback() -> None:
    """`seqtrain crd | head` closes the pipe before the CLI writes: exit 141 (SIGPIPE's shell code), stderr empty.
    The read end is closed before the CLI starts, so its first write always meets EPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", "crd"], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_crd_prints_the_committed_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["crd"]) == 0
    assert capsys.readouterr().out == (ROOT / "crds" / "seqtrainjob.yaml").read_text()


def test_run_invalid_spec_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = tmp_path / "run"
    rc = cli.main(["run", str(QUICKSTART), "--workdir", str(wd), "--set", "replicas=0", "--set", "trainng.steps=5"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{QUICKSTART}: spec.replicas: " in err
    assert f"{QUICKSTART}: spec.trainng: unknown field; did you mean 'training'?" in err
    assert "Traceback" not in err
    assert not wd.exists()


def test_run_rejects_remote_checkpoint_uri_locally(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = tmp_path / "run"
    rc = cli.main(["run", str(QUICKSTART), "--workdir", str(wd), "--set", "checkpoint.path=s3://bucket/ck"])
    assert rc == 2 and "spec.checkpoint.path" in capsys.readouterr().err
    assert not wd.exists()


def test_run_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", str(tmp_path / "missing.yaml"), "--workdir", str(tmp_path / "w")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_run_already_finished_needs_no_gang(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from seqtrain.spec import load_job_file
    from seqtrain.spec.status import JobStatus, Progress
    from seqtrain_operator.local.files import write_status

    steps = load_job_file(str(QUICKSTART)).spec.training.steps
    write_status(str(tmp_path), JobStatus(phase="Succeeded", progress=Progress(step=steps, total_steps=steps)))
    assert cli.main(["run", str(QUICKSTART), "--workdir", str(tmp_path)]) == 0
    assert "already finished" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["run"], ["run", "a.yaml", "--bogus"], ["validate"], ["frobnicate"],
                                  ["run", "a.yaml", "--workdir"],
                                  # numbers: not a number, not finite (float() takes 'nan' and 'inf'), out of range
                                  ["generate", "runs/x", "--temperature", "nan"],
                                  ["generate", "runs/x", "--temperature", "-inf"],
                                  ["generate", "runs/x", "--top-p", "inf"],
                                  ["generate", "runs/x", "--top-p", "1.5"],
                                  ["generate", "runs/x", "--max-new-tokens", "1e3"],
                                  ["generate", "runs/x", "--top-k", "0"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage: seqtrain" in capsys.readouterr().err


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it: a fresh process, its own environment."""
    full = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", *args], env=full, text=True,
                          capture_output=True, timeout=120)


@pytest.mark.slow
def test_operator_without_a_cluster_exits_2_with_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    r = _cli("operator", env={"HOME": str(home)})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    line = lines[0]
    assert "no Kubernetes cluster configured" in line
    assert "service account" in line and "KUBECONFIG (unset)" in line and f"{home}/.kube/config" in line
    assert "KUBECONFIG=/path/to/kubeconfig" in line  # how to point it at a cluster
    # a kubeconfig that is not one is named as such, still in one line
    bad = tmp_path / "broken-kubeconfig"
    bad.write_text("clusters: [\n")
    r = _cli("operator", env={"HOME": str(home), "KUBECONFIG": str(bad)})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{bad} is not a usable kubeconfig" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["table", "json"])
def test_plan_output_ends_with_a_newline(extra: list[str]) -> None:
    r = _cli("plan", str(QUICKSTART), *extra)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and not r.stdout.endswith("\n\n"), repr(r.stdout[-40:])
