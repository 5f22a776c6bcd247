"""`seqtrain generate` on a model whose ids are not text (nanoGPT's char-level recipe: data.source tokens, raw uint16
ids, model.vocabSize 65, no tokenizer): a text prompt is a one-line error naming --prompt-ids, never an IndexError
or a sample of control bytes; --prompt-ids prompts with ids and prints ids. The neighbours (an export folder, a
tokenizer with more ids than the model, an empty prompt, a prompt longer than the context) never traceback."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from seqtrain.export.weights import Weights
from seqtrain.export.writer import export
from seqtrain.models import build_model
from seqtrain.spec.model import ModelSpec
from seqtrain_operator.cli import main as cli_main

CHAR_JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {{name: chars}}
spec:
  model: {{arch: gpt, vocabSize: 65, dim: 32, layers: 1, heads: 2, ffnDim: 64, maxSeqLen: 16}}
  data: {{source: tokens, paths: [{bin}], seqLen: 16}}
  training: {{steps: 2, globalBatchSize: 2, microBatchSize: 2, schedule: {{warmupSteps: 1}}}}
  checkpoint: {{intervalSteps: 2, keep: 1}}
"""


@pytest.fixture(scope="module")
def char_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder trained (2 steps) on raw uint16 ids below 65 without a tokenizer."""
    from seqtrain.runtime.dist import DistContext
    from seqtrain.spec import RuntimeConfig, load_job, resolve
    from seqtrain.train.loop import Trainer

    tmp = tmp_path_factory.mktemp("chars")
    (np.arange(4000, dtype=np.uint16) % 65).tofile(tmp / "train.bin")
    job = resolve(load_job(CHAR_JOB.format(bin=tmp / "train.bin")))
    run = tmp / "run"
    trainer = Trainer(job, RuntimeConfig(workdir=str(run), checkpoint_dir=str(run / "checkpoints")), DistContext())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.setup()
        trainer.run()
    return run


def char_export(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    spec = ModelSpec(arch="gpt", vocab_size=65, dim=32, layers=1, heads=2, kv_heads=2, ffn_dim=64, max_seq_len=16)
    export(Weights(spec=spec, state=build_model(spec).state_dict()), str(tmp_path / "m"))
    return tmp_path / "m"


def generate(capsys: pytest.CaptureFixture[str], source: Path, *args: str) -> tuple[int, str, str]:
    code = cli_main(["generate", str(source), "--max-new-tokens", "8", "--seed", "1", "--device", "cpu", *args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_text_prompt_outside_the_vocabulary_names_the_byte_and_prompt_ids(char_run: Path, capsys) -> None:
    code, out, err = generate(capsys, char_run, "--prompt", "The ")
    assert code == 2 and out == ""
    line = one_line_error(err)
    assert "the prompt's byte 'T' is id 84, outside this model's vocabulary of 65 ids" in line
    assert "data.source: tokens without a tokenizer" in line and "--prompt-ids 1,2,3" in line


def test_a_text_prompt_inside_the_vocabulary_is_refused_not_decoded_as_bytes(char_run: Path, capsys) -> None:
    code, out, err = generate(capsys, char_run, "--prompt", " ")  # byte 32 < 65, but not this model's ' '
    assert code == 2 and out == ""
    assert "--prompt-ids" in one_line_error(err)


def test_prompt_ids_sample_and_print_ids(char_run: Path, capsys) -> None:
    code, out, err = generate(capsys, char_run, "--prompt-ids", "1, 2,3")
    assert code == 0, err
    ids = [int(x) for x in out.strip().split(",")]
    assert ids[:3] == [1, 2, 3] and len(ids) == 3 + 8 and all(0 <= i < 65 for i in ids)
    assert out.isprintable() or out.endswith("\n") and out[:-1].isprintable()


@pytest.mark.parametrize("ids", ["65", "1,2,99"])
def test_prompt_ids_outside_the_vocabulary_are_one_line(char_run: Path, capsys, ids: str) -> None:
    code, out, err = generate(capsys, char_run, "--prompt-ids", ids)
    assert code == 2 and out == ""
    assert "outside this model's vocabulary of 65 ids" in one_line_error(err)


@pytest.mark.parametrize("ids", ["", "1,,2", "-1", "1e3", "a"])
def test_prompt_ids_that_are_not_ids_are_a_usage_error(char_run: Path, capsys, ids: str) -> None:
    with pytest.raises(SystemExit) as exc:
        generate(capsys, char_run, "--prompt-ids", ids)
    assert exc.value.code == 2
    assert "--prompt-ids" in capsys.readouterr().err


def test_prompt_and_prompt_ids_exclude_each_other_and_one_is_needed(char_run: Path, capsys) -> None:
    for args in (["--prompt", "x", "--prompt-ids", "1"], []):
        with pytest.raises(SystemExit) as exc:
            generate(capsys, char_run, *args)
        assert exc.value.code == 2


def test_an_empty_prompt_is_one_line(char_run: Path, capsys) -> None:
    code, _, err = generate(capsys, char_run, "--prompt", "")
    assert code == 2 and "at least one token" in one_line_error(err)


def test_an_export_of_a_small_vocabulary_without_tokenizer(tmp_path: Path, capsys) -> None:
    folder = char_export(tmp_path)
    code, out, err = generate(capsys, folder, "--prompt", "The ")
    assert code == 2 and out == ""
    line = one_line_error(err)
    assert "is id 84, outside this model's vocabulary of 65 ids" in line and "--prompt-ids" in line
    code, out, err = generate(capsys, folder, "--prompt", "!")
    assert code == 2 and "--prompt-ids" in one_line_error(err)
    code, out, _ = generate(capsys, folder, "--prompt-ids", "7")
    assert code == 0 and all(0 <= int(i) < 65 for i in out.strip().split(","))


def test_a_byte_model_with_a_prompt_longer_than_its_context(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    spec = ModelSpec(arch="gpt", vocab_size=256, dim=32, layers=1, heads=2, kv_heads=2, ffn_dim=64, max_seq_len=16)
    export(Weights(spec=spec, state=build_model(spec).state_dict()), str(tmp_path / "m"))
    code, out, err = generate(capsys, tmp_path / "m", "--prompt", "a prompt much longer than sixteen bytes")
    assert code == 0 and out.startswith("a prompt much longer") and "its context" in err
    code, out, _ = generate(capsys, tmp_path / "m", "--prompt-ids", ",".join(["104"] * 40))
    assert code == 0 and len(out.strip().split(",")) == 48


def test_a_tokenizer_with_more_ids_than_the_model_is_one_line(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    spec = ModelSpec(arch="gpt", vocab_size=8, dim=32, layers=1, heads=2, kv_heads=2, ffn_dim=64, max_seq_len=16)
    export(Weights(spec=spec, state=build_model(spec).state_dict()), str(tmp_path / "m"), fmt="seqtrain")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(20)} | {"<unk>": 20}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    info = json.loads((tmp_path / "m" / "seqtrain.json").read_text())  # as an export of a run with this tokenizer
    info["tokenizer"] = {"type": "file", "path": "tokenizer.json"}
    (tmp_path / "m" / "seqtrain.json").write_text(json.dumps(info))
    code, out, err = generate(capsys, tmp_path / "m", "--prompt", "w1 w2")
    assert code == 0 and out.startswith("w1 w2"), err
    code, out, err = generate(capsys, tmp_path / "m", "--prompt", "w1 w12")
    assert code == 2 and out == ""
    assert "the prompt's token 'w12' is id 12, outside this model's vocabulary of 8 ids" in one_line_error(err)
