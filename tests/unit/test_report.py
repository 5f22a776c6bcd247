"""`seqtrain report` on a synthetic run folder: the table's figures come from metrics.jsonl and status.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seqtrain.obs.report import read_metrics, read_progress, report_command, summarize, table_rows


def _write_run(workdir: Path, with_status: bool = True) -> list[dict]:
    workdir.mkdir()
    records = []
    for step in range(1, 21):
        rec = {"step": step, "loss": 5.0 - 0.1 * step + (0.3 if step == 17 else 0.0), "lr": 1e-3 * (1 - step / 40),
               "grad_norm": 1.0, "tokens": 1000 + step, "slots": 1024, "tokens_per_s": 100.0 * step,
               "step_time_s": 0.5 + step / 100, "mem_peak_mb": 300.0 + step, "time": 1000.0 + 2 * step,
               "mfu": 0.01 * step, "model_tflops": 0.002 * step}
        if step in (10, 20):
            rec |= {"val_loss": {10: 4.2, 20: 4.4}[step], "val_perplexity": 1.0, "val_bpb": {10: 6.06, 20: 6.35}[step]}
        records.append(rec)
    lines = [json.dumps(r) for r in records]
    lines.insert(5, json.dumps({**records[5], "loss": 99.0}))  # a step redone after a restart: the last record wins
    (workdir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 21, "loss": 3.')  # cut by a crash
    if with_status:
        status = {"phase": "Succeeded", "restarts": 1, "infraRestarts": 1, "stepsLost": [3, 2], "goodput": 0.87,
                  "productiveSeconds": 87.0, "lostSeconds": {"queueing": 4.0, "startup": 5.0, "restart": 3.0,
                                                             "recomputed": 1.0, "checkpointStall": 0.0},
                  "progress": {"step": 20, "totalSteps": 20},
                  "conditions": [{"type": "Succeeded", "status": "True", "reason": "TrainingComplete"}]}
        (workdir / "status.json").write_text(json.dumps(status))
    return records


def test_table_matches_metrics_and_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workdir = tmp_path / "run"
    records = _write_run(workdir)
    assert report_command(str(workdir)) == 0
    png = (workdir / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    s = json.loads((workdir / "report.json").read_text())
    assert s["steps"] == 20 and s["total_steps"] == 20
    assert s["final_loss"] == pytest.approx(records[-1]["loss"])
    best = min(records, key=lambda r: r["loss"])
    assert (s["best_loss"], s["best_loss_step"]) == (pytest.approx(best["loss"]), best["step"])
    assert (s["final_val_loss"], s["best_val_loss"], s["best_val_step"]) == (4.4, 4.2, 10)
    assert s["final_val_bpb"] == 6.35
    assert s["restarts"] == 2 and s["steps_lost"] == 5 and s["goodput"] == 0.87
    assert s["tokens"] == sum(r["tokens"] for r in records)
    assert s["mean_tokens_per_s"] == pytest.approx(sum(r["tokens"] for r in records)
                                                   / sum(r["step_time_s"] for r in records))
    assert s["mean_mfu"] == pytest.approx(sum(r["mfu"] for r in records) / 20)
    assert s["mean_model_tflops"] == pytest.approx(sum(r["model_tflops"] * r["step_time_s"] for r in records)
                                                   / sum(r["step_time_s"] for r in records))
    assert s["peak_mem_mb"] == 320.0 and s["wall_s"] == 38.0
    assert s["phase"] == "Succeeded" and s["reason"] == "TrainingComplete"
    # where the time went: productive + lost = wall time; reasons that cost nothing are left out, largest first
    assert s["productive_s"] == 87.0 and s["lost_s"]["startup"] == 5.0
    rows = dict(table_rows(s))
    assert rows["wall time (productive)"] == "100 s (87.0 s productive)"
    assert rows["lost time by reason"] == "start-up 5.0 s, queueing 4.0 s, restart 3.0 s, recomputed 1.0 s"

    out = capsys.readouterr().out
    for text in ("Succeeded (TrainingComplete)", "20 / 20", "87.0%", "4.2000 (step 10)", "6.350 bits/byte",
                 f"{s['mean_tokens_per_s']:,.1f}", "10.5%", "320 MiB", str(workdir / "report.png")):
        assert text in out, text


def test_run_without_status_uses_the_trainers_progress(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    _write_run(workdir, with_status=False)
    (workdir / "progress.json").write_text(json.dumps({"step": 20, "totalSteps": 50, "stopReason": "EarlyStopped"}))
    s = summarize(read_metrics(str(workdir / "metrics.jsonl")), None, read_progress(str(workdir / "progress.json")))
    rows = dict(table_rows(s))
    assert rows["phase"] == "EarlyStopped" and rows["steps"] == "20 / 50"
    assert rows["restarts"] == "n/a" and rows["goodput"] == "n/a"


def test_cpu_run_says_why_mfu_is_empty(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "tokens": 10, "step_time_s": 1.0}))
    assert report_command(str(workdir), out=str(tmp_path / "elsewhere.png")) == 0
    assert (tmp_path / "elsewhere.png").exists()
    assert dict(table_rows(json.loads((workdir / "report.json").read_text())))["mean MFU"].startswith("n/a")


def test_bad_folders_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_command(str(tmp_path / "missing")) == 2
    assert "no such run folder" in capsys.readouterr().err
    assert report_command(str(tmp_path)) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    assert report_command(str(tmp_path)) == 2
    assert "no complete step records" in capsys.readouterr().err
