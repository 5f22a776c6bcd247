"""What `seqtrain run` says at its end, from a run folder written by hand (no rank is started): the closing line
gives the run's average tokens/s (the last step's rate labelled beside it), and Ctrl-C names the step reached."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from seqtrain.spec import load_job_file
from seqtrain.spec.status import JobStatus, Progress
from seqtrain_operator.local.display import ProgressView, run_throughput
from seqtrain_operator.local.runner import LocalRun

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def metrics(workdir: Path, steps: int, slow_last: bool = False) -> None:
    """`steps` steps of 1,000 tokens in 0.5 s (2,000 tok/s); the last one in 1 s when `slow_last`."""
    lines = []
    for s in range(1, steps + 1):
        t = 1.0 if slow_last and s == steps else 0.5
        lines.append(json.dumps({"step": s, "loss": 3.0, "tokens": 1000, "slots": 1000, "tokens_per_s": 1000 / t,
                                 "step_time_s": t, "time": 1.7e9 + s}))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def view() -> tuple[ProgressView, io.StringIO]:
    out = io.StringIO()
    return ProgressView("quickstart", 700, quiet=True, console=Console(file=out, width=300)), out


def test_the_average_counts_every_step_once() -> None:
    records = [{"step": 1, "tokens": 100, "step_time_s": 1.0, "tokens_per_s": 100.0},
               {"step": 2, "tokens": 300, "tokens_per_s": 300.0},  # no step_time_s: tokens / tokens_per_s
               {"step": 2, "tokens": 300, "step_time_s": 0.5, "tokens_per_s": 600.0},  # step 2 redone: this one
               {"step": 3, "tokens": 200, "step_time_s": 0.5, "tokens_per_s": 400.0}]
    assert run_throughput(records) == (600 / 2.0, 400.0)
    assert run_throughput([]) == (None, None)


def test_the_closing_line_gives_the_runs_average_and_labels_the_last_step(tmp_path: Path) -> None:
    metrics(tmp_path, 20, slow_last=True)
    run = LocalRun(load_job_file(str(QUICKSTART)), str(tmp_path), quiet=True)
    st = JobStatus(phase="Succeeded", progress=Progress(step=20, total_steps=700, loss=3.0, tokens_per_second=1000.0))
    v, out = view()
    assert run._finish(st, 12.0, v) == 0
    line = out.getvalue().strip().splitlines()[-1]
    # 20,000 tokens in 10.5 s of steps: 1,905 tok/s over the run; the last step alone ran at 1,000
    assert "1,905 tok/s average (last step 1,000)" in line, line


def test_ctrl_c_names_the_step_reached(tmp_path: Path) -> None:
    """Interrupted at step 14: the runner's loop may not have seen the last steps yet (it polls), and the status it
    started from has no progress at all."""
    metrics(tmp_path, 14)
    run = LocalRun(load_job_file(str(QUICKSTART)), str(tmp_path), quiet=True)
    v, out = view()
    assert run._interrupted(JobStatus(phase="Pending"), v) == 130
    assert "interrupted at step 14;" in out.getvalue(), out.getvalue()
    assert "interrupted at step 14;" in json.loads((tmp_path / "status.json").read_text())["message"]
