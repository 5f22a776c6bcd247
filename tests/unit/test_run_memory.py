"""resources.memory on this machine: the local backend samples the replicas' resident memory and kills one over it
(tests/unit/test_memory_verdict.py); a peak between two samples still shows in the ranks' own peak (ru_maxrss in
metrics.jsonl): once that passes the limit, one warning line says that a pod with this limit would be OOM-killed.
From a hand-written metrics.jsonl (no rank is started)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from seqtrain.spec import load_job_file
from seqtrain_operator.local.display import ProgressView
from seqtrain_operator.local.runner import LocalRun

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.mark.parametrize("memory,procs,peak,warned", [("10Mi", 1, 955.0, True), ("2Gi", 1, 955.0, False),
                                                     ("2Gi", 4, 955.0, True)],
                         ids=["10Mi-over", "2Gi-under", "four-ranks-over"])
def test_a_peak_over_resources_memory_is_said_once(tmp_path: Path, memory: str, procs: int, peak: float,
                                                   warned: bool) -> None:
    job = load_job_file(str(QUICKSTART), [f"resources.memory={memory}", f"resources.processesPerReplica={procs}",
                                             "training.globalBatchSize=64"])
    run = LocalRun(job, str(tmp_path), quiet=True)
    out = io.StringIO()
    view = ProgressView("quickstart", 700, quiet=True, console=Console(file=out, width=400))
    for step in (1, 2):
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": 3.0, "mem_peak_mb": peak, "time": 1.7e9 + step}) + "\n")
        run.tail.poll()
        run._check_memory(view)
    lines = out.getvalue().splitlines()
    if not warned:
        assert lines == []
        return
    assert len(lines) == 1, lines
    assert f"over resources.memory {memory}" in lines[0] and "would be OOM-killed" in lines[0]
    assert (f"{procs} ranks x 955 MiB" if procs > 1 else "reached 955 MiB") in lines[0]
