"""`seqtrain prepare-data` as a newcomer meets it (issue 42): one large text (one document) still has a validation
split (by tokens), a failed first try does not lock the folder, `--overwrite` replaces another run's shards, and a
tokenizer.json whose unknown-word token is missing from its vocabulary is a one-line error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from seqtrain.data.prepare import PrepareError, prepare
from seqtrain.data.tokens import load_prepared, split_shard
from seqtrain_operator.cli import main as cli_main


def test_one_large_text_is_split_into_train_and_validation_by_tokens(tmp_path: Path) -> None:
    text = ("First Citizen: Before we proceed any further, hear me speak.\n" * 200).encode()
    (tmp_path / "input.txt").write_bytes(text)
    prepare([str(tmp_path / "input.txt")], str(tmp_path / "out"), progress=False)
    train = load_prepared([str(tmp_path / "out")], None, "train", 0.1)
    val = load_prepared([str(tmp_path / "out")], None, "validation", 0.1)
    n = len(text) + 1  # and the end-of-document token
    assert len(val) == round(n * 0.1) and len(train) + len(val) == n
    joined = np.concatenate([np.asarray(train.tokens[np.arange(len(train))]),
                             np.asarray(val.tokens[np.arange(len(val))])])
    assert bytes(joined[:-1].astype(np.uint8)) == text  # the two splits are the text, cut once, no overlap


def test_shards_with_enough_documents_still_split_by_document() -> None:
    starts = np.arange(0, 1000, 10)  # 100 documents of 10 tokens
    s, e = split_shard(starts, 1000, 0.05, "validation")
    assert list(s) == list(range(950, 1000, 10)) and list(e - s) == [10] * 5
    s, e = split_shard(starts, 1000, 0.05, "train")
    assert len(s) == 95 and e[-1] == 950
    # two documents, 1%: too few to hold one out; the last 1% of the tokens is validation instead
    s, e = split_shard(np.array([0, 600]), 1000, 0.01, "validation")
    assert list(zip(s, e, strict=True)) == [(990, 1000)]
    s, e = split_shard(np.array([0, 600]), 1000, 0.01, "train")
    assert list(zip(s, e, strict=True)) == [(0, 600), (600, 990)]


def test_a_failed_first_try_does_not_lock_the_folder(tmp_path: Path, capsys) -> None:
    (tmp_path / "x.jsonl").write_text('{"body": "no text field"}\n')
    out = str(tmp_path / "o")
    assert cli_main(["prepare-data", str(tmp_path / "x.jsonl"), "--out", out, "-q"]) == 2
    capsys.readouterr()
    assert cli_main(["prepare-data", str(tmp_path / "x.jsonl"), "--field", "body", "--out", out, "-q"]) == 0


def test_overwrite_replaces_another_runs_shards_and_nothing_else(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.txt").write_text("alpha " * 20)
    (tmp_path / "b.txt").write_text("beta " * 30)
    out = tmp_path / "o"
    prepare([str(tmp_path / "a.txt")], str(out), progress=False)
    (out / "notes.md").write_text("mine")
    with pytest.raises(PrepareError, match="--overwrite"):
        prepare([str(tmp_path / "b.txt")], str(out), progress=False)
    assert cli_main(["prepare-data", str(tmp_path / "b.txt"), "--out", str(out), "-q", "--overwrite"]) == 0
    assert "151 tokens in 1 documents" in capsys.readouterr().out
    assert (out / "notes.md").read_text() == "mine"
    assert len(load_prepared([str(out)], None, "train", 0.0)) == 151


def test_a_tokenizer_without_its_unknown_token_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"hello": 0, "world": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("hello brave new world")
    rc = cli_main(["prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "-q",
                   "--tokenizer", str(tmp_path / "tok.json")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "'[UNK]' is not in its vocabulary" in err and "Traceback" not in err
