"""No traceback for any path argument: a path of the wrong kind (a file where a folder belongs, a folder where a
file belongs, a missing one, one under a file) is exit 2 with one line naming the argument, as a user runs the CLI
(in-process, and once in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
METRIC = {"step": 1, "loss": 5.0, "lr": 3e-4, "grad_norm": 1.0, "tokens": 64, "slots": 64, "tokens_per_s": 100.0,
          "step_time_s": 0.64, "mem_peak_mb": 500.0, "time": 1.7e9}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("paths")
    (base / "file").write_text("not a folder\n")
    (base / "dir").mkdir()
    run = base / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(METRIC) + "\n")
    return {"FILE": str(base / "file"), "DIR": str(base / "dir"), "MISSING": str(base / "missing"),
            "UNDER_FILE": str(base / "file" / "sub"), "RUN": str(run)}


CASES = {
    "run --workdir FILE": (["run", QUICKSTART, "--workdir", "FILE"], "--workdir"),
    "run --workdir UNDER_FILE": (["run", QUICKSTART, "--workdir", "UNDER_FILE"], "--workdir"),
    "run DIR": (["run", "DIR"], "DIR"),
    "run MISSING": (["run", "MISSING"], "MISSING"),
    "report FILE": (["report", "FILE"], "FILE"),
    "report --out DIR": (["report", "RUN", "--out", "DIR"], "--out"),
    "report --out UNDER_FILE": (["report", "RUN", "--out", "UNDER_FILE"], "--out"),
    "generate FILE": (["generate", "FILE", "--prompt", "a"], "FILE"),
    "export MISSING": (["export", "MISSING", "--out", "DIR"], "MISSING"),
    "plan --nodes DIR": (["plan", QUICKSTART, "--nodes", "DIR"], "DIR"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_path_of_the_wrong_kind_is_one_line_and_exit_2(case: str, paths: dict[str, str],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from seqtrain_operator import cli

    argv, named = CASES[case]
    monkeypatch.chdir(paths["DIR"])
    monkeypatch.setenv("COLUMNS", "400")
    rc = cli.main([paths.get(a, a) for a in argv])  # an exception here is the traceback a user would see
    err = capsys.readouterr().err
    assert rc == 2, f"exit {rc}\n{err}"
    assert len(err.strip().splitlines()) == 1, err
    assert paths.get(named, named) in err, err
    assert os.listdir(paths["DIR"]) == []  # nothing written where the command ran, nor into the folder given


@pytest.mark.slow
def test_as_a_user_runs_it_workdir_naming_a_file(paths: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", "run", QUICKSTART, "--workdir", paths["FILE"]],
                       capture_output=True, text=True, timeout=120, cwd=paths["DIR"])
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr}"
    assert r.stderr == f"{QUICKSTART}: --workdir {paths['FILE']}: exists and is not a folder; name a folder (it is " \
        "created when absent)\n"
