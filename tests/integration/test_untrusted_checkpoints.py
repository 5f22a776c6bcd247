"""No code runs from a file a checkpoint folder holds, whichever engine wrote it and whichever command reads it.

Real checkpoints of every engine (native, DeepSpeed, FSDP2: all write the one DCP format, `state/.metadata` a raw
pickle DCP itself would unpickle, `state/*.distcp` with byte items) get a planted pickle whose `__reduce__` would
create a marker file, or one that names os.system through DCP's own metadata module with a dotted name; meta.json's
sizes and hashes are fixed as an attacker who can write the storage would. (Every other pickle variant:
tests/unit/test_untrusted_metadata.py.) `seqtrain export` and `seqtrain generate` exit 2 naming the
file, `model.init` fails with the config error naming it, and resume sets the checkpoint aside and falls back to
the previous one: the marker never appears.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import uuid
from pathlib import Path

import pytest
from parity_util import job_for, logs, run_ranks

from seqtrain.runtime.exitcodes import InvalidConfig
from seqtrain_operator.cli import main as cli_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # a loaded 2-core machine: DeepSpeed starts slowly

ENGINES = {
    "native": {},
    "deepspeed": {"optimization.zero.stage": 2},
    "fsdp2": {"optimization.engine": "native", "optimization.zero.stage": 3},
}


class Payload:
    """Unpickling this runs a shell command: what a planted checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def _job(engine: str, steps: int = 2):  # noqa: ANN202
    return job_for({"training.steps": steps, "checkpoint.intervalSteps": 1, "checkpoint.keep": 3,
                    **ENGINES[engine]})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """engine -> a finished 2-step run with checkpoints 1 and 2, trained the first time a test asks for it."""
    root = tmp_path_factory.mktemp("engines")

    class Runs(dict):
        def __missing__(self, engine: str) -> Path:
            wd = root / engine
            assert run_ranks(_job(engine), wd, 1, timeout=900) == [0], logs(wd)
            self[engine] = wd
            return wd

    return Runs()


def _fix_meta(step: Path, name: str) -> None:
    """Record the planted file's size and hash in meta.json, as an attacker with write access would."""
    meta = json.loads((step / "meta.json").read_text())
    data = (step / name).read_bytes()
    meta["sizes"][name] = len(data)
    meta["sha256"][name] = hashlib.sha256(data).hexdigest()
    (step / "meta.json").write_text(json.dumps(meta))


def _plant_dcp_metadata(step: Path, name: str, marker: Path) -> None:
    with open(step / name, "wb") as f:
        pickle.dump(Payload(marker), f)
    _fix_meta(step, name)


def _plant_dotted_metadata(step: Path, name: str, marker: Path) -> None:
    """The attack DCP's own metadata module made possible: under pickle protocol 4 a global's name may be dotted and
    is resolved attribute by attribute, so the metadata module + `os.system` is os.system."""
    cmd = f"touch {marker}".encode()
    module, attr = b"torch.distributed.checkpoint.metadata", b"os.system"
    body = (b"\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(attr)]) + attr + b"\x93"
            + b"(\x8c" + bytes([len(cmd)]) + cmd + b"tR")
    (step / name).write_bytes(b"\x80\x04" + body + b".")
    _fix_meta(step, name)


def _plant_dcp_data(step: Path, name: str, marker: Path) -> None:
    """The DCP folder rewritten by DCP itself with one plain value of the optimizer state (a byte item in the
    .distcp file, which DCP's own loader unpickles with weights_only=False) replaced by the payload."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = step / os.path.dirname(name)
    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    state["scheduler"]["last_epoch"] = Payload(marker)
    shutil.rmtree(folder)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    meta = json.loads((step / "meta.json").read_text())
    prefix = os.path.dirname(name) + "/"
    for old in [k for k in meta["sizes"] if k.startswith(prefix)]:
        del meta["sizes"][old], meta["sha256"][old]
    (step / "meta.json").write_text(json.dumps(meta))
    for f in os.listdir(folder):
        _fix_meta(step, prefix + f)


# every engine writes the one DCP format (state/): its pickled .metadata and its byte items are the planted files
PLANTS = [
    ("native", "state/.metadata", _plant_dcp_metadata),
    ("native", "state/.metadata", _plant_dotted_metadata),
    ("deepspeed", "state/.metadata", _plant_dcp_metadata),
    ("deepspeed", "state/.metadata", _plant_dotted_metadata),
    ("deepspeed", "state/__0_0.distcp", _plant_dcp_data),
    ("fsdp2", "state/.metadata", _plant_dcp_metadata),
    ("fsdp2", "state/.metadata", _plant_dotted_metadata),
    ("fsdp2", "state/__0_0.distcp", _plant_dcp_data),
]
IDS = [f"{e}-{n}-{p.__name__.removeprefix('_plant_')}" for e, n, p in PLANTS]


def _planted_copy(runs: dict[str, Path], engine: str, name: str, plant, tmp_path: Path) -> tuple[Path, Path]:  # noqa: ANN001
    run = tmp_path / "run"
    shutil.copytree(runs[engine], run)
    step = run / "checkpoints" / "step-2"
    marker = Path(f"/tmp/PWNED-{uuid.uuid4().hex}")
    plant(step, name, marker)
    return step, marker


@pytest.mark.parametrize(("engine", "name", "plant"), PLANTS, ids=IDS)
def test_export_generate_and_model_init_refuse_a_planted_pickle(runs: dict[str, Path], engine: str, name: str,
                                                               plant, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    step, marker = _planted_copy(runs, engine, name, plant, tmp_path)
    shown = os.path.basename(name)
    assert cli_main(["export", str(step), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert shown in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert cli_main(["generate", str(step), "--prompt", "a", "--max-new-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert shown in err and "Traceback" not in err, err
    from seqtrain.export.init import load_initial_weights
    from seqtrain.models import build_model

    model = build_model(_job(engine).spec.model)
    with pytest.raises(InvalidConfig, match=r"spec\.model\.init: .*" + shown.replace(".", r"\.")):
        load_initial_weights(model, str(step))
    assert not marker.exists(), "the planted payload ran"


@pytest.mark.parametrize(("engine", "name", "plant"), PLANTS, ids=IDS)
def test_resume_sets_a_planted_checkpoint_aside_and_runs_no_code(runs: dict[str, Path], engine: str, name: str,
                                                                 plant, tmp_path: Path) -> None:  # noqa: ANN001
    step, marker = _planted_copy(runs, engine, name, plant, tmp_path)
    run = step.parent.parent
    assert run_ranks(_job(engine, steps=3), run, 1, timeout=900) == [0], logs(run)
    assert not marker.exists(), "the planted payload ran"
    reason = (run / "checkpoints" / ".bad-step-2" / "REASON").read_text()
    assert os.path.basename(name) in reason, reason
    assert "resumed from step 1" in logs(run), logs(run)


def test_a_model_folder_is_read_by_its_layout_not_by_a_planted_meta_json(runs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """A Hugging Face folder (config.json + safetensors) stays one even when a meta.json and DCP files sit beside
    it: nothing but the safetensors is read."""
    hf = tmp_path / "hf"
    assert cli_main(["export", str(runs["native"]), "--format", "hf", "--out", str(hf)]) == 0
    marker = Path(f"/tmp/PWNED-{uuid.uuid4().hex}")
    (hf / "meta.json").write_text(json.dumps({"step": 2, "engine": "fsdp2", "files": ["fsdp"]}))
    (hf / "fsdp").mkdir()
    with open(hf / "fsdp" / ".metadata", "wb") as f:
        pickle.dump(Payload(marker), f)
    assert cli_main(["export", str(hf), "--format", "hf", "--out", str(tmp_path / "again")]) == 0
    assert not marker.exists()
