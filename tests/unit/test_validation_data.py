"""`data.validation` (issue 42): validation data named explicitly for text, jsonl and tokens; nothing of data.paths
is then held out; overlap with the training data is refused at validate; splits that would leave a run without
validation data are reported at validate, not 37 s into the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from seqtrain.data.prepare import prepare
from seqtrain.data.sources import load_source
from seqtrain.spec import SpecError, parse_job
from seqtrain.spec.datafiles import data_notes, in_validation

BASE = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: v}
spec:
  model: {arch: gpt, preset: tiny}
  data: {seqLen: 16}
  training: {steps: 5, globalBatchSize: 4, microBatchSize: 2, eval: {every: 5, batches: 1}}
"""


def job(**data: object):
    doc = yaml.safe_load(BASE)
    doc["spec"]["data"].update(data)
    return parse_job(doc)


def problems(**data: object) -> dict[str, str]:
    with pytest.raises(SpecError) as exc:
        job(**data)
    return {p.path: p.message for p in exc.value.problems}


def out_of_validation(tmp_path: Path, names: list[str]) -> Path:
    """A folder under tmp_path in which none of `names` hashes into a 1% validation split (the split is by a hash
    of the path, and tmp_path differs per run: picking the folder keeps the tests deterministic)."""
    for i in range(1000):
        folder = tmp_path / f"d{i}"
        if not any(in_validation(str(folder / n), 0.01) for n in names):
            folder.mkdir()
            return folder
    raise AssertionError("no folder found")


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    folder = out_of_validation(tmp_path, ["train.txt", "val.txt"])
    (folder / "train.txt").write_text("to be or not to be " * 50)
    (folder / "val.txt").write_text("that is the question " * 20)
    return folder


def test_text_train_and_val_files_without_validation_fail_at_validate_naming_data_validation(texts: Path) -> None:
    # nanoGPT-style [train.txt, val.txt]: neither file hashes into a 1% validation split, so the run had nothing
    # to evaluate on; validate now says so and names the fix.
    got = problems(source="text", paths=[str(texts / "train.txt"), str(texts / "val.txt")])
    assert "spec.data.validation" in got and "data.validation" in got["spec.data.validation"]


def test_text_validation_named_is_the_validation_split_and_nothing_of_paths_is_held_out(texts: Path) -> None:
    j = job(source="text", paths=[str(texts / "train.txt")], validation=[str(texts / "val.txt")])
    train = load_source(j.spec.data, "train")
    val = load_source(j.spec.data, "validation")
    # each document ends with the byte tokenizer's end-of-document id (NUL)
    assert bytes(np.asarray(train.tokens)) == (texts / "train.txt").read_bytes() + b"\0"
    assert bytes(np.asarray(val.tokens)) == (texts / "val.txt").read_bytes() + b"\0"


def test_a_validation_folder_stands_for_its_files(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "held").mkdir()
    (tmp_path / "train" / "a.txt").write_text("abc " * 40)
    (tmp_path / "held" / "b.txt").write_text("xyz " * 10)
    (tmp_path / "held" / "c.txt").write_text("uvw " * 10)
    j = job(source="text", paths=[str(tmp_path / "train")], validation=[str(tmp_path / "held")])
    assert len(load_source(j.spec.data, "validation").doc_starts) == 2
    assert len(load_source(j.spec.data, "train").doc_starts) == 1


def test_validation_that_is_also_training_data_is_refused(texts: Path) -> None:
    got = problems(source="text", paths=[str(texts / "*.txt")], validation=[str(texts / "val.txt")])
    assert "also training data" in got["spec.data.validation"]
    # the same file under another name (a hard link) is the same data
    os.link(texts / "val.txt", texts / "copy-of-val.bin")
    got = problems(source="text", paths=[str(texts / "train.txt"), str(texts / "copy-of-val.bin")],
                   validation=[str(texts / "val.txt")])
    assert "also training data" in got["spec.data.validation"]


def test_validation_with_a_validation_fraction_or_the_builtin_source_is_refused(texts: Path) -> None:
    got = problems(source="text", paths=[str(texts / "train.txt")], validation=[str(texts / "val.txt")],
                   validationFraction=0.1)
    assert "spec.data.validationFraction" in got
    assert "spec.data.validation" in problems(validation=[str(texts / "val.txt")])
    assert "matches no file" in problems(source="text", paths=[str(texts / "train.txt")],
                                         validation=[str(texts / "nope.txt")])["spec.data.validation"]


def test_raw_token_files_named_as_validation_are_read_whole(tmp_path: Path) -> None:
    # nanoGPT's shakespeare_char layout: train.bin and val.bin, uint16
    np.arange(1000, dtype=np.uint16).__mod__(65).astype(np.uint16).tofile(tmp_path / "train.bin")
    (np.arange(100, dtype=np.uint16) % 65).astype(np.uint16).tofile(tmp_path / "val.bin")
    j = job(source="tokens", paths=[str(tmp_path / "train.bin")], validation=[str(tmp_path / "val.bin")])
    assert len(load_source(j.spec.data, "train")) == 1000  # nothing held out of train.bin
    assert len(load_source(j.spec.data, "validation")) == 100
    # both listed as training data: valid, but validate warns that val.bin is trained on
    both = job(source="tokens", paths=[str(tmp_path / "train.bin"), str(tmp_path / "val.bin")])
    notes = data_notes(both, True)
    assert notes and "val.bin" in notes[0] and "data.validation" in notes[0]
    assert data_notes(j, True) == []


def test_jsonl_with_too_few_records_for_the_fraction_fails_at_validate(tmp_path: Path) -> None:
    tmp_path = out_of_validation(tmp_path, ["d.jsonl:1", "d.jsonl:2", "d.jsonl:3"])
    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"text": f"record {i} " * 5}) + "\n")
    assert "spec.data.validation" in problems(source="jsonl", paths=[str(tmp_path / "d.jsonl")])
    with open(tmp_path / "v.jsonl", "w") as f:
        f.write(json.dumps({"text": "held out " * 5}) + "\n")
    j = job(source="jsonl", paths=[str(tmp_path / "d.jsonl")], validation=[str(tmp_path / "v.jsonl")])
    assert len(load_source(j.spec.data, "train").doc_starts) == 3
    assert len(load_source(j.spec.data, "validation").doc_starts) == 1


def test_prepared_folders_as_validation(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha beta " * 30)
    (tmp_path / "b.txt").write_text("gamma delta " * 30)
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "tr"), progress=False)
    prepare([str(tmp_path / "b.txt")], str(tmp_path / "va"), progress=False)
    j = job(source="tokens", paths=[str(tmp_path / "tr")], validation=[str(tmp_path / "va")])
    assert len(load_source(j.spec.data, "train")) == 331  # 330 bytes and the end-of-document token
    assert len(load_source(j.spec.data, "validation")) == 361
    assert "also training data" in problems(source="tokens", paths=[str(tmp_path / "tr")],
                                            validation=[str(tmp_path / "tr")])["spec.data.validation"]


def test_the_user_guides_nanogpt_recipe_validates_with_its_65_ids(tmp_path: Path) -> None:
    # raw token files hold ids already: the byte tokenizer's 256 does not bound model.vocabSize
    (np.arange(1000) % 65).astype(np.uint16).tofile(tmp_path / "train.bin")
    (np.arange(100) % 65).astype(np.uint16).tofile(tmp_path / "val.bin")
    doc = yaml.safe_load(BASE)
    doc["spec"]["model"] = {"arch": "gpt", "dim": 128, "layers": 4, "heads": 4, "vocabSize": 65}
    doc["spec"]["data"].update(source="tokens", paths=[str(tmp_path / "train.bin")],
                               validation=[str(tmp_path / "val.bin")])
    j = parse_job(doc)
    assert j.spec.model.vocab_size == 65


def test_a_resolved_job_with_validation_validates_again(texts: Path) -> None:
    # the local backend writes the resolved job (every field set) into the run folder; the trainer re-reads it
    j = job(source="text", paths=[str(texts / "train.txt")], validation=[str(texts / "val.txt")])
    again = parse_job(j.to_dict())
    assert again.spec.data.validation == [str(texts / "val.txt")]


def test_raw_token_ids_past_the_vocabulary_are_refused_at_validate(tmp_path: Path) -> None:
    # a GPT-2-tokenized train.bin with no model.vocabSize: the default 256 cannot embed id 50256
    np.array([10, 50256, 7], dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.array([1, 2, 3], dtype=np.uint16).tofile(tmp_path / "val.bin")
    got = problems(source="tokens", paths=[str(tmp_path / "train.bin")], validation=[str(tmp_path / "val.bin")])
    assert "50256" in got["spec.model.vocabSize"] and "at least 50257" in got["spec.model.vocabSize"]


def test_a_raw_token_folder_is_refused_naming_its_files(tmp_path: Path) -> None:
    (tmp_path / "shakespeare_char").mkdir()
    (np.arange(100) % 65).astype(np.uint16).tofile(tmp_path / "shakespeare_char" / "train.bin")
    got = problems(source="tokens", paths=[str(tmp_path / "shakespeare_char")])
    assert "not one written by `seqtrain prepare-data`" in got["spec.data.paths"]
