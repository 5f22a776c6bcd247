"""`seqtrain export` writes a whole model folder or nothing: a refusal or a failed write leaves no `--out` and no
temporary folder behind, an earlier export is replaced, a folder holding anything else is refused; and a run that
trained with its own tokenizer exports with it (the run folder keeps a copy)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from seqtrain.export import writer
from seqtrain.export.weights import Weights, WeightsError, load_source
from seqtrain.export.writer import export
from seqtrain.models import build_model
from seqtrain.spec.model import ModelSpec
from seqtrain_operator.cli import main as cli_main

SPEC = ModelSpec(arch="gpt", vocab_size=64, dim=32, layers=1, heads=2, kv_heads=2, ffn_dim=64, max_seq_len=16)


def weights(seed: int = 0, tokenizer: dict | None = None) -> Weights:
    torch.manual_seed(seed)
    return Weights(spec=SPEC, state=build_model(SPEC).state_dict(), tokenizer=tokenizer or {"type": "byte"},
                   origin="test")


def left_in(parent: Path) -> list[str]:
    return sorted(os.listdir(parent))


def test_a_refused_tokenizer_leaves_nothing_behind(tmp_path: Path) -> None:
    w = weights(tokenizer={"type": "file", "path": "/elsewhere/tokenizer.json", "refused": "named outside"})
    with pytest.raises(WeightsError, match="named outside"):
        export(w, str(tmp_path / "out"))
    assert left_in(tmp_path) == []


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    tok = tmp_path / "src" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_text("{}")
    real = writer._write_json

    def full_disk(path: str, data: dict) -> None:
        if os.path.basename(path) == "config.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(writer, "_write_json", full_disk)
    monkeypatch.setattr(writer, "load_source", lambda source: weights(tokenizer={"type": "file", "path": str(tok)}))
    assert writer.export_command("run", str(tmp_path / "out" / "model"), "hf", False) == 1
    err = capsys.readouterr().err
    assert err == f"seqtrain export: writing {tmp_path / 'out' / 'model'}: No space left on device\n", err
    assert left_in(tmp_path) == ["out", "src"] and left_in(tmp_path / "out") == []  # no model, no .model.tmp-*


def test_an_earlier_export_is_replaced_and_other_folders_are_refused(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model"
    export(weights(0), str(out))
    export(weights(1), str(out))  # replaced whole
    assert left_in(tmp_path) == ["model"]
    again = load_source(str(out)).state
    assert all(torch.equal(again[k], v) for k, v in weights(1).state.items())

    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    with pytest.raises(WeightsError, match=r"holds files that are not a seqtrain export \(todo.txt\)"):
        export(weights(0), str(mine))
    assert left_in(mine) == ["todo.txt"]

    a_file = tmp_path / "file"
    a_file.write_text("")
    assert writer.export_command(str(out), str(a_file), "hf", False) == 2
    err = capsys.readouterr().err
    assert "exists and is not a folder" in err and len(err.strip().splitlines()) == 1, err
    assert writer.export_command(str(out), str(a_file / "sub"), "hf", False) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert left_in(tmp_path) == ["file", "model", "notes"]


JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: own-tokenizer}
spec:
  model: {arch: gpt, dim: 32, layers: 1, heads: 2, ffnDim: 64, vocabSize: 64, lora: {rank: 2, alpha: 4}}
  data: {source: text, seqLen: 16}
  training: {steps: 2, globalBatchSize: 2, microBatchSize: 2, schedule: {warmupSteps: 1}}
  checkpoint: {intervalSteps: 2, keep: 1}
"""


def test_a_run_with_its_own_tokenizer_exports_merged_with_it(tmp_path: Path) -> None:
    """The newcomer's case: a LoRA run with a tokenizer.json of its own, then `export --merge-lora` of the run
    folder. The run folder holds the tokenizer the runner copied there at the start, so export finds it inside."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from seqtrain.runtime.dist import DistContext
    from seqtrain.spec import RuntimeConfig, load_job, resolve
    from seqtrain.spec.runtime import write_trainer_config
    from seqtrain.train.loop import Trainer
    from seqtrain_operator.local.runner import keep_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = [f"the rank {i % 20} writes shard {i % 7} and the gang restarts from step {i % 5}" for i in range(200)]
    for d in range(4):
        (corpus / f"doc-{d}.txt").write_text("\n".join(words[d::4]))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok_path = tmp_path / "elsewhere" / "tokenizer.json"
    tok_path.parent.mkdir()
    tok.save(str(tok_path))

    job = resolve(load_job(JOB, [f"data.paths={json.dumps([str(corpus / '*.txt')])}",
                                 f"data.tokenizer={json.dumps({'type': 'file', 'path': str(tok_path)})}"]))
    run = tmp_path / "run"
    runtime = RuntimeConfig(workdir=str(run), checkpoint_dir=str(run / "checkpoints"))
    (run / "attempts" / "1").mkdir(parents=True)
    write_trainer_config(str(run / "attempts" / "1" / "config.json"), job, runtime)
    assert keep_tokenizer(job, str(run)) is None  # what `seqtrain run` does before it starts the gang
    trainer = Trainer(job, runtime, DistContext())
    trainer.setup()
    assert trainer.run() == "completed"

    out = tmp_path / "merged"
    assert cli_main(["export", str(run), "--merge-lora", "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    assert json.loads((out / "seqtrain.json").read_text())["tokenizer"]["path"] == "tokenizer.json"
    assert left_in(tmp_path) == ["corpus", "elsewhere", "merged", "run"]
