"""A restart in place names the rank that died, how it ended and its error line (read from the launcher's and the
rank's logs, since the replica process itself never ended), each failure once; from hand-written logs."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from seqtrain.runtime.exitcodes import ERROR_MARKER
from seqtrain.spec import load_job_file
from seqtrain_operator.controller import Event
from seqtrain_operator.local.display import ProgressView
from seqtrain_operator.local.gang import LocalGang, Replica
from seqtrain_operator.local.runner import LocalRun

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
RESTART = Event("Warning", "RestartedInPlace", "attempt 1: ranks restarted in place (round 1, mode: in-place, same "
                "pods) from checkpoint step 10; restart 1/3")


def gang(logs: Path) -> LocalGang:
    """Two replicas of two ranks each, as their launchers log them (no processes)."""
    proc: Any = None
    members = [Replica(r, proc, [2 * r, 2 * r + 1], str(logs), str(logs / f"replica-{r}.log"), supervised=True)
               for r in range(2)]
    for r in range(2):
        (logs / f"replica-{r}.log").write_text("")
    return LocalGang(attempt=1, replicas=2, procs_per_replica=2, members=members)


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def test_each_failure_is_named_once_with_its_rank_exit_and_error_line(tmp_path: Path) -> None:
    g = gang(tmp_path)
    append(tmp_path / "rank-3.log", f"step 14/40 loss 2.1\n{ERROR_MARKER}RuntimeError: CUDA error: device-side assert\n")
    append(tmp_path / "replica-1.log", "seqtrain launch: local rank 1 exited with code 1; stopping the other 1 rank(s)\n")
    assert g.rank_failures() == ["rank 3 exit code 1: RuntimeError: CUDA error: device-side assert"]
    assert g.rank_failures() == []  # reported once
    # round 2: rank 0 killed from outside (no error line of its own); rank 3's old error is not repeated
    append(tmp_path / "rank-3.log", "step 15/40 loss 2.0\n")
    append(tmp_path / "replica-0.log", "seqtrain launch: local rank 0 exited with code 137; stopping the other 1 "
           "rank(s)\n")
    assert g.rank_failures() == ["rank 0 exit code 137 (killed by SIGKILL)"]
    append(tmp_path / "rank-2.log", f"{ERROR_MARKER}{'x' * 1000}\n")
    append(tmp_path / "replica-1.log", "seqtrain launch: local rank 0 exited with code 1; stopping the other 1 rank(s)\n")
    (long,) = g.rank_failures()
    assert long.startswith("rank 2 exit code 1: xxx") and len(long) <= 300


def test_the_restart_event_line_and_record_carry_the_cause(tmp_path: Path) -> None:
    run = LocalRun(load_job_file(str(QUICKSTART)), str(tmp_path), quiet=True)
    run.gang = gang(tmp_path)
    append(tmp_path / "replica-0.log", "seqtrain launch: local rank 1 exited with code 137; stopping the other 1 "
           "rank(s)\n")
    out = io.StringIO()
    run._event(RESTART, ProgressView("q", 40, quiet=True, console=Console(file=out, width=400)))
    want = (f"{RESTART.message}; cause: rank 1 exit code 137 (killed by SIGKILL)")
    assert out.getvalue() == f"[Warning] RestartedInPlace: {want}\n"
    (rec,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert rec["message"] == want
