"""Files seqtrain reads but did not necessarily write (checkpoints, model folders, token shards, tokenizers): a bad
one is refused with one line naming it, a fault of the moment never destroys a checkpoint, and nothing is followed
through a link or outside its folder."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_checkpoint import make_trainer  # the same in-process world-1 trainer

from seqtrain.checkpoint import CheckpointManager, latest_step, list_checkpoints
from seqtrain.checkpoint.discovery import KEEP_BAD, quarantined
from seqtrain.checkpoint.safe_load import CheckpointUnavailable
from seqtrain.runtime.dist import DistContext
from seqtrain.runtime.exitcodes import InvalidConfig
from seqtrain_operator.cli import main as cli_main


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run with checkpoints 4 and 6 (copied by each test that changes it)."""
    wd = tmp_path_factory.mktemp("run")
    assert make_trainer(wd).run() == "completed"
    assert [c.step for c in list_checkpoints(str(wd / "ckpt"))] == [4, 6]
    return wd


@pytest.fixture()
def run(trained: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _write_x(directory: str) -> list[str]:
    Path(directory, "x.pt").write_text("good")
    return ["x.pt"]


# ---- resume: corrupt vs. could not load now ----------------------------------------------------------------------
@pytest.mark.parametrize("fault", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   OSError(errno.EIO, "Input/output error"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered")],
                         ids=["cuda-oom", "eio", "cuda-error"])
def test_a_load_that_fails_for_the_moment_keeps_every_checkpoint(run: Path, fault: Exception,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise fault

    monkeypatch.setattr(torch, "load", failing_load)
    with pytest.raises(CheckpointUnavailable, match=r"step-6/state/__0_0\.distcp: could not be loaded now"):
        make_trainer(run)
    monkeypatch.undo()
    assert quarantined(str(run / "ckpt")) == [] and latest_step(str(run / "ckpt")) == 6  # nothing set aside
    assert make_trainer(run).resumed_from.step == 6  # the next attempt, with memory back, resumes from it


def test_could_not_load_now_is_an_infrastructure_failure_for_the_controller() -> None:
    from seqtrain.runtime import exitcodes
    from seqtrain.runtime.launch import replica_exit_code
    from seqtrain_operator.controller.failure_policy import FailureClass, classify
    from seqtrain_operator.controller.types import ReplicaObservation

    assert replica_exit_code([exitcodes.COMM_TIMEOUT, exitcodes.CHECKPOINT_UNAVAILABLE]) == 6
    assert exitcodes.CHECKPOINT_UNAVAILABLE in exitcodes.RETRYABLE
    obs = ReplicaObservation(replica=0, attempt=1, phase="Failed", exit_code=6, node="n1",
                             error="CheckpointUnavailable: /c/step-6/state/__0_0.distcp: could not be loaded now")
    f = classify(obs)
    assert f.cls is FailureClass.INFRASTRUCTURE and f.reason == "CheckpointUnavailable" and f.node is None


def test_a_full_volume_is_an_infrastructure_failure_that_avoids_no_node() -> None:
    """The hour-long chaos soak (seed 20261128): a checkpoint volume full for 28 s failed a rank with ENOSPC twice
    (once in a save, once at the restart that met it still full), both charged to maxRestarts, and the job Failed
    within the budget of the faults it was given. A full volume is the storage's fault: exit 7, infraRestarts."""
    import errno

    from seqtrain.runtime import exitcodes
    from seqtrain_operator.controller.failure_policy import FailureClass, classify
    from seqtrain_operator.controller.types import ReplicaObservation

    full = OSError(errno.ENOSPC, "No space left on device")
    assert exitcodes.storage_full(full)
    try:  # wrapped, as a save thread's error re-raised by the loop is
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("async checkpoint save of step 20 failed") from inner
    except RuntimeError as outer:
        assert exitcodes.storage_full(outer)
    assert not exitcodes.storage_full(OSError(errno.EIO, "I/O error"))
    assert not exitcodes.storage_full(ValueError("No space left on device"))  # only the errno says so
    assert exitcodes.STORAGE_FULL in exitcodes.RETRYABLE
    obs = ReplicaObservation(replica=0, attempt=1, phase="Failed", exit_code=7, node="n1",
                             error="OSError: [Errno 28] No space left on device")
    f = classify(obs)
    assert f.cls is FailureClass.INFRASTRUCTURE and f.reason == "StorageFull" and f.node is None
    assert "checkpoint.keep" in f.message


def test_a_same_size_bit_flip_is_caught_by_its_hash_and_the_previous_checkpoint_used(run: Path) -> None:
    engine = run / "ckpt" / "step-6" / "state" / "__0_0.distcp"  # the DCP format's data file
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the tensor data: the size stays valid
    engine.write_bytes(bytes(data))
    t = make_trainer(run, steps=8)
    assert t.resumed_from.step == 4
    (step, reason), = quarantined(str(run / "ckpt"))
    assert step == 6 and "__0_0.distcp: sha256" in reason, reason


def test_nothing_in_a_checkpoint_is_followed_through_a_link(run: Path, tmp_path: Path) -> None:
    trainer_pt = run / "ckpt" / "step-6" / "trainer.pt"
    elsewhere = tmp_path / "elsewhere.pt"
    trainer_pt.rename(elsewhere)
    trainer_pt.symlink_to(elsewhere)  # same size, same bytes: only the link is wrong
    assert make_trainer(run, steps=8).resumed_from.step == 4
    (step, reason), = quarantined(str(run / "ckpt"))
    assert step == 6 and "trainer.pt: a symbolic link" in reason, reason


def test_a_reason_link_in_a_step_folder_never_makes_the_trainer_write_its_target(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "c"), keep=3, ctx=DistContext())
    mgr.save(4, _write_x)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    step = tmp_path / "c" / "step-4"
    (step / "REASON").symlink_to(victim)
    (step / "x.pt").write_text("!")  # truncated: the checkpoint is set aside with a REASON
    assert mgr.latest() is None
    assert victim.read_text() == "precious\n"
    reason_file = tmp_path / "c" / ".bad-step-4" / "REASON"
    assert not reason_file.is_symlink() and "REASON: a symbolic link" in reason_file.read_text()
    # and a REASON link planted in a set-aside folder is never read back into events
    reason_file.unlink()
    reason_file.symlink_to(victim)
    assert quarantined(str(tmp_path / "c")) == [(4, "unusable (no REASON file)")]


def test_set_aside_folders_are_pruned_to_a_bounded_number(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=10, ctx=DistContext())
    for step in range(1, KEEP_BAD + 4):
        mgr.save(step, _write_x)
        (tmp_path / f"step-{step}" / "x.pt").write_text("!")
        mgr.latest()  # sets it aside
    assert [s for s, _ in quarantined(str(tmp_path))] == list(range(4, KEEP_BAD + 4))


def test_meta_json_file_entries_may_not_leave_the_folder(run: Path) -> None:
    meta_path = run / "ckpt" / "step-6" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["sizes"]["../../../../etc/hostname"] = 1
    meta_path.write_text(json.dumps(meta))
    assert make_trainer(run, steps=8).resumed_from.step == 4
    (_, reason), = quarantined(str(run / "ckpt"))
    assert "points outside the checkpoint folder" in reason


# ---- SIGTERM and the grace period ----------------------------------------------------------------------------
def test_sigterm_saves_only_when_the_last_save_fits_in_the_grace_period(tmp_path: Path, capsys,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEQTRAIN_FAULT_TERM_AT_STEP", "3")
    monkeypatch.setenv("SEQTRAIN_TERM_GRACE_SECONDS", "0.000001")  # no save can fit (the one of step 2 took longer)
    t = make_trainer(tmp_path / "short")
    assert t.run() == "terminated" and t.step == 3
    assert latest_step(str(tmp_path / "short" / "ckpt")) == 2  # no checkpoint started that SIGKILL would cut
    out = capsys.readouterr().out
    assert "SIGTERM at step 3: not saving a checkpoint" in out and "resumes from step 2" in out, out
    monkeypatch.setenv("SEQTRAIN_TERM_GRACE_SECONDS", "600")
    t = make_trainer(tmp_path / "long")
    assert t.run() == "terminated" and latest_step(str(tmp_path / "long" / "ckpt")) == 3


# ---- model folders: export and generate -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    assert cli_main(["export", str(trained / "ckpt" / "step-6"), "--format", "hf", "--out", str(out)]) == 0
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_export_refuses_an_index_entry_that_leaves_the_folder(hf_folder: Path, tmp_path: Path, capsys) -> None:
    model = _copy(hf_folder, tmp_path / "model")
    outside = tmp_path / "outside.safetensors"
    (model / "model.safetensors").rename(outside)
    from safetensors import safe_open

    with safe_open(str(outside), "pt") as f:
        names = list(f.keys())
    entry = "../outside.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, entry)}))
    assert cli_main(["export", str(model), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert entry in err and "model.safetensors.index.json" in err and "Traceback" not in err, err


def test_export_never_copies_a_tokenizer_a_checkpoint_names_outside_itself(trained: Path, tmp_path: Path,
                                                                          capsys) -> None:
    step = _copy(trained / "ckpt" / "step-6", tmp_path / "step-6")
    secret = tmp_path / "secret" / "tokenizer.json"
    secret.parent.mkdir()
    secret.write_text('{"not": "yours"}')
    meta = json.loads((step / "meta.json").read_text())
    meta["job"]["spec"]["data"]["tokenizer"] = {"type": "file", "path": str(secret)}
    (step / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "out"
    assert cli_main(["export", str(step), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(secret) in err and "meta.json" in err and "outside" in err, err
    assert not (out / "tokenizer.json").exists()


def test_generate_names_a_missing_gpu_instead_of_a_traceback(hf_folder: Path, capsys) -> None:
    rc = cli_main(["generate", str(hf_folder), "--prompt", "a", "--max-new-tokens", "1", "--device", "cuda:7"])
    err = capsys.readouterr().err
    assert rc == 2 and "--device cuda:7" in err and "Traceback" not in err, err


def test_generate_with_a_garbage_tokenizer_is_one_line(hf_folder: Path, tmp_path: Path, capsys) -> None:
    model = _copy(hf_folder, tmp_path / "model")
    (model / "seqtrain.json").unlink()  # a plain Hugging Face folder: its tokenizer.json is the tokenizer
    (model / "tokenizer.json").write_text("{ this is not a tokenizer")
    rc = cli_main(["generate", str(model), "--prompt", "a", "--max-new-tokens", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer.json" in err and "Traceback" not in err, err


# ---- data files ---------------------------------------------------------------------------------------------------
def test_a_garbage_tokenizer_is_an_invalid_config_for_the_trainer(tmp_path: Path) -> None:
    from seqtrain.data.sources import FileTokenizer

    bad = tmp_path / "tokenizer.json"
    bad.write_text("garbage")
    with pytest.raises(InvalidConfig, match=r"spec\.data\.tokenizer\.path: .*tokenizer\.json: not a tokenizer"):
        FileTokenizer(str(bad))


def test_prepare_data_names_a_garbage_tokenizer_and_a_non_text_column(tmp_path: Path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("hello world\n")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("garbage")
    assert cli_main(["prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o1"), "--tokenizer",
                     str(bad), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {bad}" in err and "Traceback" not in err, err
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    assert cli_main(["prepare-data", str(tmp_path / "ints.parquet"), "--out", str(tmp_path / "o2"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "ints.parquet: column 'text' holds int64, not text" in err and "Traceback" not in err, err


@pytest.fixture()
def prepared(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "b.txt").write_text("second document, a little longer\n")
    assert cli_main(["prepare-data", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--out",
                     str(tmp_path / "tok"), "-q"]) == 0
    return tmp_path / "tok"


def test_a_truncated_token_shard_is_named(prepared: Path) -> None:
    from seqtrain.data.tokens import load_prepared

    shard = prepared / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(InvalidConfig, match=r"shard-00000\.bin: \d+ bytes, but index\.json says"):
        load_prepared([str(prepared)], None, "train", 0.0)


def test_document_offsets_past_the_shard_end_are_refused(prepared: Path) -> None:
    from seqtrain.data.tokens import load_prepared

    docs = prepared / "shard-00000.docs.npy"
    starts = np.load(docs)
    np.save(docs, np.append(starts, starts[-1] + 10_000))
    with pytest.raises(InvalidConfig, match=r"shard-00000\.docs\.npy: document offsets must .* stay below"):
        load_prepared([str(prepared)], None, "train", 0.0)


def test_an_index_shard_name_may_not_leave_the_folder(prepared: Path) -> None:
    from seqtrain.data.tokens import load_prepared

    index = json.loads((prepared / "index.json").read_text())
    index["shards"][0]["name"] = "../../etc/shard"
    (prepared / "index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidConfig, match=r"shards\[0\]\.name '\.\./\.\./etc/shard' must be a file name"):
        load_prepared([str(prepared)], None, "train", 0.0)


def test_every_unpickling_goes_through_the_one_loader() -> None:
    """No torch.load / pickle.load / np.load(allow_pickle=True) outside seqtrain.checkpoint.safe_load."""
    import io
    import tokenize

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for base in ("trainer/seqtrain", "operator/seqtrain_operator"):
        for path in (root / base).rglob("*.py"):
            if path.name == "safe_load.py":
                continue
            # code only: comments and strings may name the calls they explain
            toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            code = " ".join(t.string for t in toks if t.type not in (tokenize.COMMENT, tokenize.STRING))
            code = code.replace(" . ", ".").replace(" (", "(").replace(" = ", "=")
            for needle in ("torch.load(", "pickle.load", "pickle.loads", "allow_pickle=True", "weights_only=False",
                           "Unpickler("):
                if needle in code:
                    offenders.append(f"{path.relative_to(root)}: {needle}")
    assert offenders == []
