"""`microBatchSize: auto` at start-up (the walk-through's qs-9-auto.txt): its choice and reason are said once, not
as a phase line and again in the next phase's "(... took 0.0s)". Rank 0's log as `resolve_auto` writes it (the
probe faked), read by the local view."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from seqtrain.spec import load_job_file
from seqtrain.train import autobatch
from seqtrain_operator.local.display import ProgressView, StartupWatch

QUICK = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
WHY = ("microBatchSize auto -> 8, gradient accumulation 1 (all 8 sequences a rank takes per step: 758.6 MiB of "
       "900.0 MiB, by the estimate); probe step: 820.0 MiB per replica of resources.memory 900Mi")


def test_the_auto_choice_appears_once_and_its_probing_is_a_phase(monkeypatch, capsys, tmp_path: Path) -> None:
    import seqtrain.data

    job = load_job_file(QUICK, ["training.microBatchSize=auto", "resources.memory=900Mi"])
    monkeypatch.setattr(seqtrain.data, "build_train_data", lambda *a, **k: None)  # no corpus for a faked probe
    monkeypatch.setattr(autobatch, "choose", lambda j, device, agree: (j, WHY))
    capsys.readouterr()
    _, reason = autobatch.resolve_auto(job, "cpu", is_main=True)
    assert reason == WHY
    log = tmp_path / "rank-0.log"
    log.write_text("seqtrain phase: rendezvous of 2 rank(s)\n" + capsys.readouterr().out
                   + "seqtrain phase: building the model\n")
    out = io.StringIO()  # not a terminal: the phases are plain lines
    view = ProgressView("quickstart", 40, quiet=False, console=Console(file=out, width=400))
    with view:
        StartupWatch(view, clock=lambda: 1000.0).follow(str(log), None)
    text = out.getvalue()
    assert text.count("microBatchSize auto -> 8") == 1, text
    lines = [ln for ln in text.splitlines() if ln.startswith("quickstart:")]
    assert lines == [
        "quickstart: starting the rank processes ...",
        "quickstart: rendezvous of 2 rank(s) ... (starting the rank processes took 0.0s)",
        f"quickstart: {autobatch.PHASE} ... (rendezvous of 2 rank(s) took 0.0s)",
        f"quickstart: {WHY}",
        f"quickstart: building the model ... ({autobatch.PHASE} took 0.0s)",
    ]


@pytest.mark.parametrize("terminal", [True, False])
def test_the_choice_is_a_line_with_or_without_a_live_bar(tmp_path: Path, terminal: bool) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text(f"{autobatch.MARKER}{WHY}\n")
    out = io.StringIO()
    view = ProgressView("quickstart", 40, quiet=False, console=Console(file=out, width=400))
    view.terminal = terminal
    StartupWatch(view, clock=lambda: 1000.0).follow(str(log), None)
    assert out.getvalue().count(WHY) == 1
