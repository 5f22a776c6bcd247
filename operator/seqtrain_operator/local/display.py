"""What the user sees: a progress bar fed by metrics.jsonl, event lines, and the loss plot at the end."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from seqtrain_operator.local.files import read_metrics


class ProgressView:
    """A rich progress bar (step, loss, tokens/s, ETA); with quiet=True it shows nothing but what `line()` prints."""

    def __init__(self, name: str, total_steps: int, quiet: bool, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.quiet = quiet
        self._bar: Progress | None = None
        self._task: Any = None
        if not quiet:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False,
            )
            self._task = self._bar.add_task(name, total=total_steps, loss="-", tps="-")

    def __enter__(self) -> ProgressView:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, step: int, loss: float | None, tokens_per_s: float | None) -> None:
        if self._bar is None:
            return
        self._bar.update(self._task, completed=step,
                         loss=f"{loss:.4f}" if loss is not None else "-",
                         tps=f"{tokens_per_s:,.0f}" if tokens_per_s is not None else "-")

    def line(self, text: str, always: bool = False) -> None:
        """An event line above the bar (suppressed when quiet unless `always`)."""
        if self.quiet and not always:
            return
        # soft_wrap: never break a path or a message at the terminal width (logs and pipes keep whole lines).
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)


def run_throughput(records: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(run average, last step) tokens/s of metrics.jsonl records. The average is every step's tokens over the
    time spent in steps (`step_time_s`, else tokens / tokens_per_s), so one fast or slow step does not stand for the
    run and the pauses between attempts do not count; a step appears once however often it was redone."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if isinstance(r.get("step"), int):
            by_step[r["step"]] = r  # a resumed run rewrites its steps: the last record of a step counts
    tokens = seconds = 0.0
    for r in by_step.values():
        n, t, tps = r.get("tokens"), r.get("step_time_s"), r.get("tokens_per_s")
        if not isinstance(n, int | float):
            continue
        if not isinstance(t, int | float):
            t = n / tps if isinstance(tps, int | float) and tps > 0 else None
        if t is not None and t > 0:
            tokens, seconds = tokens + n, seconds + t
    last = by_step[max(by_step)].get("tokens_per_s") if by_step else None
    return (tokens / seconds if seconds > 0 else None), (float(last) if isinstance(last, int | float) else None)


def plot_loss(metrics_path: str, out_path: str, title: str) -> str | None:
    """Draw loss per step into `out_path` (PNG). Returns None on success or why it was skipped."""
    records = read_metrics(metrics_path)
    points = [(int(r["step"]), float(r["loss"])) for r in records if isinstance(r.get("loss"), int | float)]
    if not points:
        return "no metrics to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: render straight to a file
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'seqtrain[train]')"
    points.sort()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out_path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out_path)
    return None
