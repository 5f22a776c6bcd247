"""`seqtrain report WORKDIR [--out FILE]`: a one-page PNG of a run and its key figures in the terminal.

Reads `metrics.jsonl` (the trainer: one line per step, `val_*` on evaluation steps) and, when present,
`status.json` (the controller: restarts, steps lost to restarts, goodput and where the wall time went
(`productiveSeconds`, `lostSeconds`), phase and its reason). Writes
`report.png` (loss and validation loss, learning rate, tokens/s with MFU, memory; the table underneath) and
`report.json` (the same figures, for scripts) into the run folder.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from seqtrain.spec.progress_doc import MAX_DOC_BYTES, ProgressError, parse_progress
from seqtrain.spec.status import JobStatus, Progress

EXIT_OK, EXIT_INVALID = 0, 2


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Step records in step order; a line cut by a crash is skipped, a repeated step keeps its last record."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def read_status(path: str) -> JobStatus | None:
    try:
        with open(path, encoding="utf-8") as f:
            return JobStatus.model_validate(json.load(f))
    except (OSError, ValueError):
        return None


def read_progress(path: str) -> Progress | None:
    """`<workdir>/progress.json` through the one progress reader (None when absent or refused)."""
    try:
        with open(path, "rb") as f:
            return parse_progress(f.read(MAX_DOC_BYTES + 1)).progress
    except (OSError, ProgressError):
        return None


def _num(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _values(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], v) for r in records if (v := _num(r, key)) is not None]


def summarize(
    records: list[dict[str, Any]], status: JobStatus | None, progress: Progress | None = None
) -> dict[str, Any]:
    """The report's key figures (None where the run has no data for one). `progress`: used without status."""
    losses = _values(records, "loss")
    vals = _values(records, "val_loss")
    tokens = sum(_num(r, "tokens") or 0.0 for r in records)
    seconds = sum(_num(r, "step_time_s") or 0.0 for r in records)
    tps = [v for _, v in _values(records, "tokens_per_s")]
    mfus = [v for _, v in _values(records, "mfu")]
    mems = [v for _, v in _values(records, "mem_peak_mb")]
    times = [v for _, v in _values(records, "time")]
    best_loss = min(losses, key=lambda sv: sv[1]) if losses else None
    best_val = min(vals, key=lambda sv: sv[1]) if vals else None
    if status is not None and status.progress is not None:
        progress = status.progress
    phase_reason = None
    if status is not None:
        cond = next((c for c in status.conditions if c.type == status.phase and c.status == "True"), None)
        phase_reason = cond.reason if cond else None
    return {
        "phase": status.phase if status else None,
        "reason": (progress.stop_reason if progress and progress.stop_reason else phase_reason),
        "steps": records[-1]["step"] if records else 0,
        "total_steps": progress.total_steps if progress and progress.total_steps else None,
        "final_loss": losses[-1][1] if losses else None,
        "best_loss": best_loss[1] if best_loss else None,
        "best_loss_step": best_loss[0] if best_loss else None,
        "final_val_loss": vals[-1][1] if vals else None,
        "best_val_loss": best_val[1] if best_val else None,
        "best_val_step": best_val[0] if best_val else None,
        "final_val_bpb": _values(records, "val_bpb")[-1][1] if _values(records, "val_bpb") else None,
        "restarts": (status.restarts + status.infra_restarts) if status else None,
        "steps_lost": sum(status.steps_lost) if status else None,
        "goodput": status.goodput if status else None,
        "productive_s": status.productive_seconds if status else None,
        "lost_s": status.lost_seconds.model_dump() if status and status.lost_seconds else None,
        "tokens": int(tokens),
        # time-weighted: total real tokens over total step time (a per-step mean over-weights fast steps)
        "mean_tokens_per_s": tokens / seconds if seconds > 0 else (sum(tps) / len(tps) if tps else None),
        "mean_mfu": sum(mfus) / len(mfus) if mfus else None,
        # time-weighted like tokens/s: total model FLOPs over total step time
        "mean_model_tflops": (sum((_num(r, "model_tflops") or 0.0) * (_num(r, "step_time_s") or 0.0) for r in records)
                              / seconds if seconds > 0 and _values(records, "model_tflops") else None),
        "peak_mem_mb": max(mems) if mems else None,
        "wall_s": times[-1] - times[0] if len(times) > 1 else None,
    }


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "n/a"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "loss":
        return f"{value:.4f}"
    if kind == "mb":
        return f"{value:,.0f} MiB"
    if kind == "s":
        return f"{value:,.0f} s" if value >= 100 else f"{value:.1f} s"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


_LOST_LABELS = {"queueing": "queueing", "startup": "start-up", "checkpoint_stall": "checkpoint stall",
                "restart": "restart", "recomputed": "recomputed", "suspended": "suspended"}


def _wall(s: dict[str, Any]) -> str:
    if s["productive_s"] is None:
        return "n/a"
    wall = s["productive_s"] + sum((s["lost_s"] or {}).values())
    return f"{_fmt(wall, 's')} ({_fmt(s['productive_s'], 's')} productive)"


def _lost(lost: dict[str, float] | None) -> str:
    """The lost reasons that cost anything, largest first (status.lostSeconds; they add up with productive)."""
    if lost is None:
        return "n/a"
    parts = [f"{_LOST_LABELS.get(k, k)} {_fmt(v, 's')}" for k, v in sorted(lost.items(), key=lambda kv: -kv[1])
             if v >= 0.05]
    return ", ".join(parts) or "none"


def table_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    steps = f"{s['steps']:,}" + (f" / {s['total_steps']:,}" if s["total_steps"] else "")
    at = lambda step: f" (step {step})" if step is not None else ""  # noqa: E731
    return [
        ("phase", (s["reason"] or "n/a") if s["phase"] is None
         else s["phase"] + (f" ({s['reason']})" if s["reason"] else "")),
        ("steps", steps),
        ("final loss", _fmt(s["final_loss"], "loss")),
        ("best loss", _fmt(s["best_loss"], "loss") + at(s["best_loss_step"])),
        ("final val loss", _fmt(s["final_val_loss"], "loss")
         + (f" ({s['final_val_bpb']:.3f} bits/byte)" if s["final_val_bpb"] is not None else "")),
        ("best val loss", _fmt(s["best_val_loss"], "loss") + at(s["best_val_step"])),
        ("restarts", _fmt(s["restarts"], "int")),
        ("steps lost to restarts", _fmt(s["steps_lost"], "int")),
        ("goodput", _fmt(s["goodput"], "pct")),
        ("wall time (productive)", _wall(s)),
        ("lost time by reason", _lost(s["lost_s"])),
        ("tokens trained", _fmt(s["tokens"], "int")),
        ("mean tokens/s", _fmt(s["mean_tokens_per_s"])),
        ("mean model TFLOP/s", f"{s['mean_model_tflops']:.4g}" if s["mean_model_tflops"] is not None else "n/a"),
        ("mean MFU", _fmt(s["mean_mfu"], "pct") if s["mean_mfu"] is not None else "n/a (no known peak, e.g. CPU)"),
        ("peak memory", _fmt(s["peak_mem_mb"], "mb")),
        ("wall time of the steps", _fmt(s["wall_s"], "s")),
    ]


def draw(records: list[dict[str, Any]], rows: list[tuple[str, str]], title: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 12.5), layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 0.9])
    fig.suptitle(title, fontsize=14)

    def plot(ax: Any, key: str, label: str, **kw: Any) -> bool:
        pts = _values(records, key)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **kw)
        return bool(pts)

    ax = fig.add_subplot(grid[0, 0])
    plot(ax, "loss", "train loss", lw=1)
    if plot(ax, "val_loss", "validation loss", marker="o", lw=1.5):
        ax.legend()
    ax.set(title="loss", xlabel="step", ylabel="nats / token")

    ax = fig.add_subplot(grid[0, 1])
    plot(ax, "lr", "lr")
    ax.set(title="learning rate", xlabel="step")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))

    ax = fig.add_subplot(grid[1, 0])
    plot(ax, "tokens_per_s", "tokens/s", lw=1)
    ax.set(title="throughput (real tokens/s, all ranks)", xlabel="step")
    if _values(records, "mfu"):
        twin = ax.twinx()
        plot(twin, "mfu", "MFU", color="tab:red", lw=1)
        twin.set_ylabel("MFU", color="tab:red")

    ax = fig.add_subplot(grid[1, 1])
    plot(ax, "mem_peak_mb", "peak memory")
    ax.set(title="peak memory of the busiest rank", xlabel="step", ylabel="MiB")

    ax = fig.add_subplot(grid[2, :])
    ax.axis("off")
    tab = ax.table(cellText=[[k, v] for k, v in rows], colLabels=["", "value"], loc="center", cellLoc="left",
                   colWidths=[0.35, 0.55])
    tab.auto_set_font_size(False)
    tab.set_fontsize(10)
    tab.scale(1, 1.35)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def print_table(rows: list[tuple[str, str]], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a core dependency; plain text keeps the command usable regardless
        print(title)
        for k, v in rows:
            print(f"  {k:<24} {v}")
        return
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def report_command(workdir: str, out: str | None = None) -> int:
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isdir(workdir):
        print(f"seqtrain report: {workdir}: no such run folder", file=sys.stderr)
        return EXIT_INVALID
    if not os.path.isfile(metrics_path):
        print(f"seqtrain report: {workdir}: no metrics.jsonl yet (has the run started a step?)", file=sys.stderr)
        return EXIT_INVALID
    records = read_metrics(metrics_path)
    if not records:
        print(f"seqtrain report: {metrics_path}: no complete step records", file=sys.stderr)
        return EXIT_INVALID
    status = read_status(os.path.join(workdir, "status.json"))
    # Without status.json (e.g. `seqtrain train` by hand) the trainer's own progress.json still knows the
    # total steps and why it stopped.
    summary = summarize(records, status, read_progress(os.path.join(workdir, "progress.json")))
    rows = table_rows(summary)
    title = f"seqtrain report: {os.path.basename(os.path.normpath(workdir))}"
    out = out or os.path.join(workdir, "report.png")
    draw(records, rows, title, out)
    with open(os.path.join(workdir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print_table(rows, title)
    print(f"report: {out}")
    return EXIT_OK
