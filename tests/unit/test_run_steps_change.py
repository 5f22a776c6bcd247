"""`seqtrain run` with other training.steps on a run folder whose newest checkpoint was made for fewer (the
walk-through's `--set training.steps=2500` on a finished 2000-step run): the local runner makes the trainer's own
resume check before starting any rank, exits 2 with the trainer's line, and leaves the folder (a Succeeded status
included) as it was, instead of a rank refusing at resume and the finished run being marked Failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seqtrain.optim.schedules import resume_steps_change
from seqtrain.spec import load_job_file, resolve
from seqtrain.spec.status import JobStatus, Progress
from seqtrain_operator import cli
from seqtrain_operator.local.files import write_status
from seqtrain_operator.local.runner import resume_problem

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
DONE = 700  # the quickstart's training.steps (cosine schedule)


def finished_run(tmp_path: Path) -> Path:
    """A run folder as a finished quickstart leaves it: status Succeeded, a complete checkpoint at its last step."""
    run = tmp_path / "run"
    step = run / "checkpoints" / f"step-{DONE}"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": DONE, "files": [], "total_steps": DONE}))
    write_status(str(run), JobStatus(phase="Succeeded", progress=Progress(step=DONE, total_steps=DONE)))
    return run


def test_more_steps_on_a_finished_cosine_run_exit_2_before_any_rank(tmp_path: Path, capsys) -> None:
    run = finished_run(tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    rc = cli.main(["run", str(QUICKSTART), "--workdir", str(run), "--set", f"training.steps={DONE + 300}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and "Traceback" not in err
    # the rank's own words (seqtrain.optim.schedules.steps_change), prefixed as the trainer's InvalidConfig is
    assert lines[0].startswith(f"quickstart: spec.training.steps: training.steps is {DONE + 300}, the checkpoint at "
                               f"step {DONE} was made for {DONE}: the cosine schedule is recomputed")
    assert "training.allowScheduleChange: true" in lines[0] and f"keep training.steps {DONE}" in lines[0]
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert after == {p: b for p, b in before.items() if p.name != "run.lock"}  # status Succeeded, no job.yaml
    assert json.loads((run / "status.json").read_text())["phase"] == "Succeeded"
    assert not (run / "attempts").exists()


def test_the_runner_says_what_the_trainer_would_raise(tmp_path: Path) -> None:
    """One rule: the runner's line is the trainer's `spec.training.steps: ` + resume_steps_change's message."""
    from seqtrain.runtime.exitcodes import InvalidConfig
    from seqtrain.train.loop import Trainer

    run = finished_run(tmp_path)
    job = load_job_file(str(QUICKSTART), [f"training.steps={DONE + 300}"])
    line = resume_problem(job, str(run / "checkpoints"))
    trainer = type("T", (), {"spec": resolve(job).spec, "step": DONE, "total_steps": DONE + 300})()
    with pytest.raises(InvalidConfig) as exc:
        Trainer._check_steps_change(trainer, DONE)  # type: ignore[arg-type]
    assert line == str(exc.value)


@pytest.mark.parametrize("overrides", [
    ["training.steps=1000", "training.allowScheduleChange=true"],  # allowed: the trainer continues and says so
    [f"training.steps={DONE}"],  # the steps the checkpoint was made for
    ["training.steps=1000", "training.schedule.name=constant"],  # the next learning rate does not move
])
def test_a_change_the_trainer_accepts_is_not_refused(tmp_path: Path, overrides: list[str]) -> None:
    run = finished_run(tmp_path)
    assert resume_problem(load_job_file(str(QUICKSTART), overrides), str(run / "checkpoints")) is None


def test_no_checkpoint_or_no_record_is_nothing_to_check(tmp_path: Path) -> None:
    job = load_job_file(str(QUICKSTART), ["training.steps=1000"])
    assert resume_problem(job, str(tmp_path / "none")) is None
    run = finished_run(tmp_path)
    meta = run / "checkpoints" / f"step-{DONE}" / "meta.json"
    meta.write_text(json.dumps({"step": DONE, "files": []}))  # an older checkpoint without total_steps
    assert resume_problem(job, str(run / "checkpoints")) is None
    assert resume_steps_change(resolve(job).spec.training, DONE, None) is None
