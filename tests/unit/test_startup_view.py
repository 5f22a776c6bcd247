"""Start-up is visible: rank 0 announces its phases in its log, the local view names each on the bar with its
elapsed time and, where there is no live bar (output redirected), prints them and a progress line per tenth of the
run as plain lines. From hand-written logs and a fake clock."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from seqtrain.runtime.exitcodes import PHASE_MARKER, announce_phase, phase_of
from seqtrain_operator.local.display import ProgressView, StartupWatch


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def redirected(total: int = 20) -> tuple[ProgressView, io.StringIO]:
    out = io.StringIO()  # not a terminal: what `seqtrain run job.yaml > run.log` gets
    return ProgressView("tiny", total, quiet=False, console=Console(file=out, width=300)), out


def test_the_marker_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    announce_phase("building the model")
    line = capsys.readouterr().out
    assert line == f"{PHASE_MARKER}building the model\n" and phase_of(line) == "building the model"
    assert phase_of("step 1/20 loss 5.1") is None


def test_redirected_output_names_each_phase_with_its_time_then_progress(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text("")
    view, out = redirected()
    clock = Clock()
    watch = StartupWatch(view, clock)
    with view:
        watch.follow(str(log), None)  # the gang was started: its processes import
        clock.now += 4.0
        for what, seconds in (("rendezvous of 2 rank(s)", 0.5), ("building the deepspeed engine (DeepSpeed compiles "
                                                                  "its ops on first use)", 313.0),
                              ("loading the data", 1.2), ("first step (compile, warm-up)", 2.0)):
            with open(log, "a") as f:
                f.write(f"some library's own output\n{PHASE_MARKER}{what}\n")
            watch.follow(str(log), None)
            clock.now += seconds
            watch.follow(str(log), None)  # still in it
        watch.follow(str(log), clock.now - 0.1)  # the first step was written
        for step in range(1, 21):
            view.update(step, 4.0, 1000.0)
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("tiny:")]
    assert lines[:6] == [
        "tiny: starting the rank processes ...",
        "tiny: rendezvous of 2 rank(s) ... (starting the rank processes took 4.0s)",
        "tiny: building the deepspeed engine (DeepSpeed compiles its ops on first use) ... (rendezvous of 2 rank(s) "
        "took 0.5s)",
        "tiny: loading the data ... (building the deepspeed engine (DeepSpeed compiles its ops on first use) took "
        "313.0s)",
        "tiny: first step (compile, warm-up) ... (loading the data took 1.2s)",
        "tiny: training (first step (compile, warm-up) took 2.0s; start-up 320.7s)",
    ]
    progress = lines[6:]
    assert progress[0] == "tiny: step 1/20, loss 4.0000, 1,000 tok/s"
    assert progress[-1] == "tiny: step 20/20, loss 4.0000, 1,000 tok/s" and len(progress) == 11  # step 1, then tenths


def test_the_bar_shows_the_phase_and_its_elapsed_time(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text(f"{PHASE_MARKER}loading checkpoint step 10\n")
    view, out = redirected()
    view.terminal = True  # a live bar: no plain lines
    clock = Clock()
    watch = StartupWatch(view, clock)
    watch.follow(str(log), clock.now - 60)  # a step of the previous round: start-up not over
    clock.now += 42
    watch.follow(str(log), clock.now - 60)
    assert view._bar is not None
    assert view._bar.tasks[0].description == "tiny [loading checkpoint step 10 42s]"  # read at the first call
    watch.follow(str(log), clock.now)
    assert view._bar.tasks[0].description == "tiny"
    assert out.getvalue() == ""
