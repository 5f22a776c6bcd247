"""`seqtrain prepare-data` and `data.source: tokens` over its shards: every input kind, end-of-document tokens and
a document index, parallel workers, resume, blending, packing on real document boundaries."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from seqtrain.data.prepare import PrepareError, prepare
from seqtrain.data.tokens import load_prepared
from seqtrain_operator.cli import main as cli_main

EOD = 256


def docs_of(out: Path) -> list[bytes]:
    """Every document of a byte-level prepared folder, in shard order, without its EOD."""
    index = json.loads((out / "index.json").read_text())
    got = []
    for shard in index["shards"]:
        toks = np.fromfile(out / f"{shard['name']}.bin", dtype=index["dtype"])
        starts = np.load(out / f"{shard['name']}.docs.npy")
        for a, b in zip(starts, [*starts[1:], len(toks)], strict=True):
            doc = toks[a:b]
            assert doc[-1] == EOD and EOD not in doc[:-1]  # one EOD, at the end
            got.append(bytes(doc[:-1].astype(np.uint8)))
    return got


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[list[str], list[bytes]]:
    """One input of every kind; returns (inputs, documents in the expected order)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("first file\nwith two lines\n")
    (src / "b.txt").write_text("second file: é ü\n")
    (src / "c.jsonl").write_text('{"text": "json one"}\n\n{"text": "json two", "id": 2}\n{"text": "json three"}\n')
    table = pa.table({"text": [f"parquet row {i}" for i in range(6)], "n": list(range(6))})
    pq.write_table(table, src / "d.parquet", row_group_size=4)  # two row groups: two units
    datasets.Dataset.from_dict({"text": ["dataset row a", "dataset row b", ""]}).save_to_disk(str(tmp_path / "ds"))
    inputs = [str(src / "*.txt"), str(src / "c.jsonl"), str(src / "d.parquet"), str(tmp_path / "ds")]
    want = [b"first file\nwith two lines\n", "second file: é ü\n".encode(), b"json one", b"json two", b"json three",
            *[f"parquet row {i}".encode() for i in range(6)], b"dataset row a", b"dataset row b"]
    return inputs, want


@pytest.mark.slow
def test_every_input_kind_becomes_documents_with_eod_and_an_index(corpus, tmp_path: Path) -> None:
    inputs, want = corpus
    out = tmp_path / "out"
    info = prepare(inputs, str(out), workers=2, progress=False)
    assert docs_of(out) == want
    assert info["documents"] == len(want) and info["tokens"] == sum(len(d) + 1 for d in want)
    assert info["vocab_size"] == 257 and info["eod"] == EOD and info["dtype"] == "uint16"
    assert len(info["shards"]) == 5  # the 2 text files together, 1 jsonl range, 2 parquet row groups, 1 dataset range


def test_a_rerun_resumes_from_the_shards_that_exist(corpus, tmp_path: Path) -> None:
    inputs, _ = corpus
    out = tmp_path / "out"
    prepare(inputs, str(out), progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name.startswith("shard-")}
    (out / "index.json").unlink()
    (out / "shard-00003.bin").unlink()  # as if killed while writing unit 3 (only its .tmp would exist)
    (out / "shard-00003.bin.tmp").write_bytes(b"partial")
    info = prepare(inputs, str(out), progress=False)
    assert info["resumed_shards"] == 4 and info["new_tokens"] == info["shards"][3]["tokens"]
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name.startswith("shard-")}
    assert after == before
    with pytest.raises(PrepareError, match="other inputs or settings"):
        prepare(inputs[:1], str(out), progress=False)


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys) -> None:
    (tmp_path / "x.jsonl").write_text('{"body": "no text field"}\n')
    assert cli_main(["prepare-data", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o"), "-q"]) == 2
    assert "no string field 'text'; use --field" in capsys.readouterr().err
    assert cli_main(["prepare-data", str(tmp_path / "nothing*"), "--out", str(tmp_path / "o2"), "-q"]) == 2
    assert "matches no file" in capsys.readouterr().err
    assert cli_main(["prepare-data", str(tmp_path / "x.jsonl"), "--field", "body", "--out", str(tmp_path / "o3"),
                     "-q"]) == 0
    assert "1 documents" in capsys.readouterr().out


def test_tokenizer_json_uses_its_eos_token_as_eod(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world"] * 20 + ["tokens and more tokens"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("hello world tokens")
    info = prepare([str(tmp_path / "t.txt")], str(tmp_path / "out"), tokenizer=str(tmp_path / "tokenizer.json"),
                   progress=False)
    assert info["eod"] == tok.token_to_id("<|endoftext|>") and info["vocab_size"] == tok.get_vocab_size()
    toks = np.fromfile(tmp_path / "out" / "shard-00000.bin", dtype=np.uint16)
    assert tok.decode(toks[:-1].tolist()).strip() == "hello world tokens" and toks[-1] == info["eod"]
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def _prepared(tmp_path: Path, name: str, docs: list[bytes]) -> Path:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": d.decode()}) + "\n" for d in docs))
    prepare([str(src)], str(tmp_path / name), progress=False)
    return tmp_path / name


def test_tokens_source_keeps_document_boundaries_for_packing(tmp_path: Path) -> None:
    from seqtrain.data import build_train_data
    from seqtrain.spec import parse_job, resolve

    rng = np.random.default_rng(0)
    docs = [bytes(rng.integers(97, 123, size=int(n)).astype(np.uint8)) for n in rng.integers(3, 60, size=300)]
    out = _prepared(tmp_path, "p", docs)
    train = load_prepared([str(out)], None, "train", 0.1)
    val = load_prepared([str(out)], None, "validation", 0.1)
    assert len(train.doc_starts) + len(val.doc_starts) == 300 and len(val.doc_starts) == 30
    first = train.tokens[np.arange(train.doc_starts[1])]
    assert bytes(first[:-1].astype(np.uint8)) == docs[0] and first[-1] == EOD
    job = resolve(parse_job({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "t"},
                             "spec": {"data": {"source": "tokens", "paths": [str(out)], "seqLen": 64,
                                               "packing": True, "validationFraction": 0.1},
                                      "training": {"globalBatchSize": 4, "microBatchSize": 4}}}))
    assert job.spec.model.vocab_size == 257  # the EOD id is part of the vocabulary
    batch = build_train_data(job, 0, 1).next_step()[0]
    toks, doc_ids, targets = batch.tokens.numpy(), batch.doc_ids.numpy(), batch.targets.numpy()
    for r in range(toks.shape[0]):
        for d in np.unique(doc_ids[r][doc_ids[r] >= 0]):
            piece = toks[r][doc_ids[r] == d]
            assert EOD not in piece[:-1]  # a piece never spans two documents
            if piece[-1] == EOD:  # a document's last token predicts nothing across the boundary
                assert targets[r][doc_ids[r] == d][-1] == -100


def test_blend_weights_set_each_datasets_share_of_tokens(tmp_path: Path) -> None:
    a = _prepared(tmp_path, "a", [b"a" * 20] * 200)  # 4200 tokens
    b = _prepared(tmp_path, "b", [b"b" * 10] * 100)  # 1100 tokens
    corpus = load_prepared([str(a), str(b)], [0.2, 0.8], "train", 0.0, seed=1)
    toks = corpus.tokens[np.arange(len(corpus))]
    share_b = float((toks == ord("b")).sum() + 0) / float(((toks == ord("a")) | (toks == ord("b"))).sum())
    assert abs(share_b - 0.8) < 0.02  # b repeated about 3.9 times, a subsampled
    assert abs(len(corpus) - 5300) < 40  # the epoch keeps the datasets' total size
    # deterministic for a seed
    again = load_prepared([str(a), str(b)], [0.2, 0.8], "train", 0.0, seed=1)
    assert np.array_equal(again.doc_starts, corpus.doc_starts)


def test_blend_weights_are_validated(tmp_path: Path) -> None:
    from seqtrain.spec import SpecError, parse_job

    a = _prepared(tmp_path, "a", [b"abc"] * 5)
    doc = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "t"},
           "spec": {"data": {"source": "tokens", "paths": [str(a)], "weights": [0.5, 0.5]}}}
    with pytest.raises(SpecError, match="spec.data.weights: 2 weights for 1 paths"):
        parse_job(doc)
    doc["spec"]["data"]["weights"] = [1.0]
    doc["spec"]["model"] = {"vocabSize": 256}
    with pytest.raises(SpecError, match="spec.model.vocabSize: 256 is smaller than the prepared data's vocabulary 257"):
        parse_job(doc)


def test_tokenizer_folder_is_taken_as_model_init_takes_it(tmp_path: Path, capsys) -> None:
    """--tokenizer FOLDER (a Hugging Face model folder) reads its tokenizer.json and carries its special tokens and
    chat template into the output; a folder without one is a one-line error."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model = tmp_path / "model"
    model.mkdir()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world"] * 20, trainers.BpeTrainer(vocab_size=280,
                                                                      special_tokens=["<unk>", "</s>"]))
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "{{ x }}"}))
    (tmp_path / "t.txt").write_text("hello world")
    assert cli_main(["prepare-data", str(tmp_path / "t.txt"), "--tokenizer", str(model), "--out",
                     str(tmp_path / "out"), "-q"]) == 0
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["eod"] == tok.token_to_id("</s>") and index["vocab_size"] == tok.get_vocab_size()
    assert index["tokenizer"]["path"] == str(tmp_path / "out" / "tokenizer.json")
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"] == "{{ x }}"
    by_file = prepare([str(tmp_path / "t.txt")], str(tmp_path / "out2"), tokenizer=str(model / "tokenizer.json"),
                      progress=False)
    assert (tmp_path / "out" / "shard-00000.bin").read_bytes() == (tmp_path / "out2" / "shard-00000.bin").read_bytes()
    assert by_file["tokens"] == index["tokens"]
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    assert cli_main(["prepare-data", str(tmp_path / "t.txt"), "--tokenizer", str(tmp_path / "empty"), "--out",
                     str(tmp_path / "out3"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tokenizer" in err and "no tokenizer.json" in err
