"""Data sources: text glob, jsonl field, memory-mapped token files, synthetic tasks, tokenizer.json; each goes
through `build_train_data` and resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from seqtrain.data import build_train_data, load_corpus
from seqtrain.data.sources import ConcatTokens, FileTokenizer, load_source
from seqtrain.data.synthetic import generate, special_ids
from seqtrain.data.tokenizer import ByteTokenizer
from seqtrain.spec import load_job, resolve
from seqtrain.spec.data import DataSpec, SyntheticSpec
from seqtrain.spec.resolve import tokenizer_vocab_size

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {{name: src}}
spec:
  model: {{arch: gpt, preset: tiny}}
  data: {data}
  training: {{steps: 5, globalBatchSize: 4, microBatchSize: 2}}
"""

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly", "hex", "jovial", "bakers"]


def text(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(20 + 13 * (i % 5)))


@pytest.fixture
def files(tmp_path: Path) -> Path:
    for i in range(30):
        (tmp_path / f"doc{i:02d}.txt").write_text(text(i))
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"id": i, "body": text(i)}) + "\n")
    arr = np.arange(5000, dtype=np.uint16) % 300
    arr.tofile(tmp_path / "a.bin")
    (np.arange(3000, dtype=np.uint16) % 200 + 1000).tofile(tmp_path / "b.bin")
    return tmp_path


def tokenizer_json(tmp_path: Path, special: tuple[str, ...] = ("[UNK]",)) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text(i) for i in range(10)], trainers.WordLevelTrainer(special_tokens=list(special)))
    path = str(tmp_path / f"tokenizer-{len(special)}.json")
    tok.save(path)
    return path


def job_for(data: dict) -> object:
    return resolve(load_job(JOB.format(data=json.dumps(data))))


def assert_exact_resume(job: object) -> None:
    a = build_train_data(job, 0, 1)
    a.next_step()
    b = build_train_data(job, 0, 1)
    b.load_state_dict(a.state_dict())
    for _ in range(4):
        for x, y in zip(a.next_step(), b.next_step(), strict=True):
            assert torch.equal(x.tokens, y.tokens) and torch.equal(x.targets, y.targets)


def test_text_glob_split_and_resume(files: Path) -> None:
    data = {"source": "text", "paths": [str(files / "*.txt")], "seqLen": 32, "validationFraction": 0.2}
    job = job_for(data)
    train, val = load_corpus(job, "train"), load_corpus(job, "validation")
    assert len(train.doc_starts) + len(val.doc_starts) == 30 and len(val.doc_starts) > 0
    total = sum(len(text(i).encode()) for i in range(30))
    assert len(train) + len(val) == total + 30  # each file ends with the end-of-document byte (NUL)
    assert_exact_resume(job)
    assert_exact_resume(job_for(data | {"packing": True}))


def test_jsonl_field_and_clear_error_for_missing_field(files: Path) -> None:
    job = job_for({"source": "jsonl", "paths": [str(files / "data.jsonl")], "jsonlField": "body", "seqLen": 32})
    c = load_corpus(job, "train")
    first = bytes(np.asarray(c.tokens[: c.doc_starts[1]])).decode()
    assert first.endswith("\x00") and first[:-1] in {text(i) for i in range(60)}  # record + end-of-document
    ends = np.asarray(c.tokens)[np.asarray(c.doc_starts[1:]) - 1]
    assert (ends == ByteTokenizer.eos_id).all()  # every document ends with it, and only its last byte is NUL
    assert int((np.asarray(c.tokens) == 0).sum()) == len(c.doc_starts)
    assert_exact_resume(job)
    with pytest.raises(ValueError, match=r"data.jsonl:1: no field 'text'.*jsonlField"):
        load_source(DataSpec(source="jsonl", paths=[str(files / "data.jsonl")]), "train")


def test_token_files_are_memory_mapped_and_split_by_tail(files: Path) -> None:
    spec = DataSpec(source="tokens", paths=[str(files / "*.bin")], validation_fraction=0.1)
    train, val = load_source(spec, "train"), load_source(spec, "validation")
    assert isinstance(train.tokens, ConcatTokens) and len(train) + len(val) == 8000
    assert list(train.doc_starts) == [0, 4500]
    assert train.tokens[np.array([0, 4499, 4500, 7199])].tolist() == [0, 4499 % 300, 1000, 2699 % 200 + 1000]
    # raw token files carry no vocabulary: ids up to 1199 need model.vocabSize 1200 (validate refuses less)
    job = resolve(load_job(JOB.format(data=json.dumps({"source": "tokens", "paths": [str(files / "*.bin")],
                                                       "seqLen": 32})), ["model.vocabSize=1200"]))
    assert_exact_resume(job)
    batch = build_train_data(job, 0, 1).next_step()[0]
    assert batch.tokens.max() < 1200
    (files / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="tokenDtype"):
        load_source(DataSpec(source="tokens", paths=[str(files / "odd.bin")]), "train")


def test_documents_end_with_the_tokenizers_end_of_text_token(files: Path) -> None:
    path = tokenizer_json(files, ("[UNK]", "<|endoftext|>"))
    eos = FileTokenizer(path).eos_id
    assert eos is not None and FileTokenizer(tokenizer_json(files)).eos_id is None  # no such token: nothing added
    data = {"source": "text", "paths": [str(files / "*.txt")], "seqLen": 16, "tokenizer": {"type": "file", "path": path}}
    c = load_corpus(job_for(data), "train")
    tokens = np.asarray(c.tokens)
    assert (tokens[np.append(np.asarray(c.doc_starts[1:]), len(tokens)) - 1] == eos).all()
    assert int((tokens == eos).sum()) == len(c.doc_starts)


def test_tokenizer_json_encodes_text_and_sets_vocab(files: Path) -> None:
    path = tokenizer_json(files)
    tok = FileTokenizer(path)
    ids = tok.encode("the quick brown fox")
    assert len(ids) == 4 and tok.decode(ids) == "the quick brown fox"
    data = {"source": "text", "paths": [str(files / "*.txt")], "seqLen": 16,
            "tokenizer": {"type": "file", "path": path}}
    job = job_for(data)
    assert job.spec.model.vocab_size == tok.vocab_size == tokenizer_vocab_size(job)
    c = load_corpus(job, "train")
    assert int(np.max(c.tokens)) < tok.vocab_size and len(c) < 30 * 60  # words, not bytes
    assert_exact_resume(job)


@pytest.mark.parametrize("task", ["copy", "recall"])
def test_synthetic_tasks_score_only_answers(task: str) -> None:
    spec = SyntheticSpec(task=task, length=6, vocab=10)
    c = generate(spec, 50, seed=1)
    sp = special_ids(10)
    docs = np.split(np.asarray(c.tokens), c.doc_starts[1:])
    masks = np.split(c.loss_mask, c.doc_starts[1:])
    for d, m in zip(docs, masks, strict=True):
        assert d[0] == sp["bos"] and d[-1] == sp["eos"] and d.max() < 14
        if task == "copy":
            assert (d[1:7] == d[8:14]).all() and m.sum() == 7  # the copy and EOS
        else:
            keys, vals = d[1:7:2], d[2:7:2]
            assert len(set(keys.tolist())) == 3 and d[7] == sp["query"]
            assert d[9] == vals[list(keys).index(d[8])] and m.sum() == 1 and m[9]
    job = job_for({"source": "synthetic", "synthetic": {"task": task, "length": 6, "vocab": 10}, "seqLen": 16})
    assert job.spec.model.vocab_size == 14
    assert_exact_resume(job)
    # train and validation examples come from different seeds
    assert not np.array_equal(load_corpus(job, "train").tokens[:100], load_corpus(job, "validation").tokens[:100])


def test_missing_files_name_the_pattern(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="spec.data.paths"):
        load_source(DataSpec(source="text", paths=[str(tmp_path / "none*.txt")]), "train")


def test_spec_rejects_impossible_data_settings() -> None:
    from seqtrain.spec import SpecError

    data = {"source": "synthetic", "seqLen": 16, "maxTokensPerBatch": 8,
            "synthetic": {"task": "recall", "length": 40, "vocab": 8}}
    with pytest.raises(SpecError) as err:
        job_for(data)
    paths = [p.path for p in err.value.problems]
    assert paths.count("spec.data.synthetic.length") == 2 and "spec.data.maxTokensPerBatch" in paths
