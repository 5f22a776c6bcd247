"""What the user sees: a progress bar fed by metrics.jsonl, event lines, and the loss plot at the end.

Before the first step the bar names rank 0's start-up phase (rendezvous, model, engine, data, checkpoint, first step:
`seqtrain.runtime.exitcodes.PHASE_MARKER` lines in its log) with its elapsed time; `microBatchSize: auto`'s choice
(its `AUTO_MARKER` line) is printed once, as a line. When the output is not a terminal (a file, a pipe, CI) there is
no live bar: the phases and a progress line every tenth of the run are plain lines.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from seqtrain.runtime.exitcodes import phase_of
from seqtrain.spec.memory import AUTO_MARKER
from seqtrain_operator.local.files import read_metrics


class ProgressView:
    """A rich progress bar (step, loss, tokens/s, ETA); with quiet=True it shows nothing but what `line()` prints."""

    def __init__(self, name: str, total_steps: int, quiet: bool, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.quiet = quiet
        self.name, self.total_steps = name, total_steps
        self.terminal = self.console.is_terminal  # else: plain lines instead of a live bar
        self._bar: Progress | None = None
        self._task: Any = None
        self._reported_tenth = -1
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
        tenth = step * 10 // max(1, self.total_steps)
        if not self.terminal and tenth > self._reported_tenth and step > 0:
            self._reported_tenth = tenth
            self.line(f"{self.name}: step {step}/{self.total_steps}, loss "
                      f"{f'{loss:.4f}' if loss is not None else '-'}, "
                      f"{f'{tokens_per_s:,.0f}' if tokens_per_s is not None else '-'} tok/s")
        self._bar.update(self._task, completed=step,
                         loss=f"{loss:.4f}" if loss is not None else "-",
                         tps=f"{tokens_per_s:,.0f}" if tokens_per_s is not None else "-")

    def phase(self, what: str | None) -> None:
        """Name the start-up phase on the bar (None: training, the bar shows the job's name again)."""
        if self._bar is not None:
            self._bar.update(self._task, description=self.name if what is None else f"{self.name} [{what}]")

    def note(self, text: str) -> None:
        """A line printed only where there is no live bar to show it (not a terminal), unless quiet."""
        if not self.terminal:
            self.line(text)

    def line(self, text: str, always: bool = False) -> None:
        """An event line above the bar (suppressed when quiet unless `always`)."""
        if self.quiet and not always:
            return
        # soft_wrap: never break a path or a message at the terminal width (logs and pipes keep whole lines).
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)


class StartupWatch:
    """Follows rank 0's log for the start-up phases it announces and shows each on the view with its elapsed time,
    until a step is written after the start-up began (an in-place restart starts up again in the same log)."""

    SLACK_SECONDS = 1.0  # a phase line is read up to a poll after it was written; a restart takes longer than this

    def __init__(self, view: ProgressView, clock: Any = time.time) -> None:
        self.view, self.clock = view, clock
        self._path: str | None = None
        self._offset = 0
        self._partial = ""
        self._phase: str | None = None
        self._since = self._began = 0.0

    def follow(self, log_path: str | None, last_step_time: float | None) -> None:
        """`log_path`: rank 0's log of the running attempt (None: no gang); `last_step_time`: the wall time of the
        newest metrics.jsonl record (a step written after the start-up began ends it)."""
        now = self.clock()
        if log_path != self._path:
            self._path, self._offset, self._partial = log_path, 0, ""
            if log_path is not None:  # a new gang: its processes import their libraries before rank 0 says more
                self._enter("starting the rank processes", now)
        for line in self._new_lines():
            if (what := phase_of(line)) is not None:
                self._enter(what, now)
            elif line.startswith(AUTO_MARKER):  # microBatchSize auto's choice and why: once, above the bar
                self.view.line(f"{self.view.name}: {line[len(AUTO_MARKER):].strip()}")
        stepped = last_step_time is not None and last_step_time > self._began - self.SLACK_SECONDS
        if self._phase is not None and stepped:
            self.view.note(f"{self.view.name}: training ({self._phase} took {now - self._since:.1f}s; start-up "
                           f"{now - self._began:.1f}s)")
            self._phase = None
            self.view.phase(None)
        elif self._phase is not None:
            self.view.phase(f"{self._phase} {now - self._since:.0f}s")

    def _enter(self, what: str, now: float) -> None:
        if self._phase is None:
            self._began = now
            self.view.note(f"{self.view.name}: {what} ...")
        else:
            self.view.note(f"{self.view.name}: {what} ... ({self._phase} took {now - self._since:.1f}s)")
        self._phase, self._since = what, now

    def _new_lines(self) -> list[str]:
        if self._path is None:
            return []
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        self._offset += len(data)
        lines = (self._partial + data.decode("utf-8", "replace")).split("\n")
        self._partial = lines.pop()  # an unterminated line is completed by a later write
        return lines


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
