"""Fuzzing the file readers: DCP `.metadata`, a checkpoint's meta.json, the JSON files of a model folder, token shards
with their document offsets and index, and tokenizer.json. Each gets random bytes and structured mutations of a real
file (truncation, bit flips, huge declared lengths, deep nesting); the invariant: the project's own error naming the
file (or the checkpoint set aside with a one-line reason), never another exception, a hang or unbounded memory.
Inputs that once broke something are kept as explicit `@example`s.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickletools
import resource
import shutil
import signal
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from seqtrain.checkpoint.safe_load import CheckpointUnavailable, UnusableCheckpoint
from seqtrain.runtime.exitcodes import InvalidConfig

pytestmark = pytest.mark.fuzz

EXAMPLE_SECONDS = 60  # one example on a loaded 2-core machine; a reader that takes longer is hanging
RSS_GROWTH_MB = 1024  # what the whole test may add to the process's peak resident memory


@contextlib.contextmanager
def bounded(what: str) -> Iterator[None]:
    """Fail (not hang) when one example runs past EXAMPLE_SECONDS."""
    def expire(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise AssertionError(f"{what}: still reading after {EXAMPLE_SECONDS} s (a hang)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, EXAMPLE_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=True)
def _memory_stays_bounded() -> Iterator[None]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown < RSS_GROWTH_MB, f"peak resident memory grew by {grown:.0f} MiB"


def _one_line(exc: BaseException, name: str) -> None:
    text = str(exc)
    assert "\n" not in text.strip() and name in text, text


# ---- mutations ------------------------------------------------------------------------------------------------
@st.composite
def mutated(draw: st.DrawFn, base: bytes, length_fields: list[tuple[int, int]] | None = None) -> bytes:
    """`base` truncated, with bits flipped, bytes overwritten or inserted, a declared length made huge (at one of
    `length_fields`: (offset, width) of little-endian lengths), or replaced by random bytes."""
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "huge", "random"]))
    data = bytearray(base)
    if kind == "truncate":
        return bytes(data[:draw(st.integers(0, max(len(data) - 1, 0)))])
    if kind == "random":
        return draw(st.binary(max_size=4096))
    if kind == "huge" and length_fields:
        at, width = draw(st.sampled_from(length_fields))
        value = draw(st.sampled_from([2**(width * 8) - 1, 2**(width * 8 - 1), 10**12, len(base) + 1]))
        data[at:at + width] = (value % 2**(width * 8)).to_bytes(width, "little")
        return bytes(data)
    for _ in range(draw(st.integers(1, 8))):
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            data[pos] = draw(st.integers(0, 255))
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(
    max_size=20)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=10), inner, max_size=4), max_leaves=20)


@st.composite
def json_mutated(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    """A JSON file: `base` with one field set to any JSON value (or removed), nested deeper than any parser
    follows, a number of 5000 digits, text cut short, random bytes, or any JSON document."""
    kind = draw(st.sampled_from(["field", "drop", "deep", "digits", "truncate", "bytes", "any"]))
    if kind in ("field", "drop") and base:
        doc = json.loads(json.dumps(base))
        key = draw(st.sampled_from(sorted(doc)))
        if kind == "drop":
            del doc[key]
        else:
            doc[key] = draw(JSON_VALUES)
        return json.dumps(doc).encode()
    if kind == "deep":
        depth = draw(st.sampled_from([100, 1000, 5000, 100_000]))
        opener = draw(st.sampled_from(["[", '{"a":']))
        closer = "]" if opener == "[" else "}"
        return (opener * depth + "1" + closer * depth).encode()
    if kind == "digits":
        doc = dict(base)
        doc[draw(st.sampled_from(sorted(doc)))] = 0
        return json.dumps(doc).replace(": 0", ": " + "9" * 5000, 1).encode()
    if kind == "truncate":
        text = json.dumps(base).encode()
        return text[:draw(st.integers(0, len(text) - 1))]
    if kind == "bytes":
        return draw(st.binary(max_size=512))
    return json.dumps(draw(JSON_VALUES)).encode()


# ---- DCP .metadata -----------------------------------------------------------------------------------------------
_BUILT: dict[str, Any] = {}


def _dcp_folder() -> Path:
    """A real DCP folder (built once per session; each example rewrites only its .metadata)."""
    if "dcp" not in _BUILT:
        import torch.distributed.checkpoint as dcp

        folder = Path(tempfile.mkdtemp(prefix="seqtrain-fuzz-dcp-")) / "state"
        state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
                 "optim": {"state": {"w": {"step": torch.tensor(1.0)}}}, "scheduler": {"last_epoch": 3},
                 "lst": [torch.ones(2), 5]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(folder), no_dist=True)
        _BUILT["dcp"] = folder
        _BUILT["dcp_meta"] = (folder / ".metadata").read_bytes()
    return _BUILT["dcp"]


def _pickle_length_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every declared length in a pickle: FRAME, BINUNICODE, BINBYTES and friends."""
    widths = {"FRAME": 8, "SHORT_BINUNICODE": 1, "BINUNICODE": 4, "BINUNICODE8": 8, "SHORT_BINBYTES": 1,
              "BINBYTES": 4, "BINBYTES8": 8, "LONG1": 1, "LONG4": 4, "BYTEARRAY8": 8}
    out = []
    with contextlib.suppress(Exception):
        for op, _, pos in pickletools.genops(data):
            if op.name in widths:
                out.append((pos + 1, widths[op.name]))
    return out


def _dcp_meta_inputs() -> st.SearchStrategy[bytes]:
    _dcp_folder()
    base = _BUILT["dcp_meta"]
    return mutated(base, _pickle_length_fields(base))


@given(data=st.deferred(_dcp_meta_inputs))
@example(data=b"\x80\x04\x95" + (2**40).to_bytes(8, "little") + b".")  # a FRAME claiming a terabyte
@example(data=b"\x80\x04\x8e" + (2**62).to_bytes(8, "little"))  # BINBYTES8 declaring 4 EiB
@example(data=b"\x80\x04\x95" + (2**63).to_bytes(8, "little") + b".")  # OverflowError escaped the C Unpickler
# found by this fuzzer (seed 102) after the first fixes: BYTEARRAY8 allocates its declared length before reading
@example(data=b"\x80\x05\x96" + (2**40).to_bytes(8, "little") + b".")
@example(data=b"\x80\x04]" + b"(" * 100_000 + b".")  # 100,000 MARKs
def test_fuzz_dcp_metadata(data: bytes) -> None:
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from seqtrain.checkpoint.safe_load import dcp_load, read_dcp_metadata

    folder = _dcp_folder()
    (folder / ".metadata").write_bytes(data)
    with bounded("DCP .metadata"):
        try:
            read_dcp_metadata(str(folder / ".metadata"))
        except UnusableCheckpoint as exc:
            _one_line(exc, ".metadata")
            return
        state: dict = {}  # accepted: then loading it reads only this folder's bytes, in bounded memory
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp_load(str(folder), lambda reader: _load_state_dict(
                    state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True))
        except UnusableCheckpoint as exc:
            _one_line(exc, str(folder))


# ---- a checkpoint's meta.json: discovery, the manager, export ---------------------------------------------------
def _checkpoint_template() -> Path:
    """A real checkpoint folder `<tmp>/ckpt/step-6` of a tiny in-process run (built once)."""
    if "ckpt" not in _BUILT:
        from test_checkpoint import make_trainer

        wd = Path(tempfile.mkdtemp(prefix="seqtrain-fuzz-run-"))
        assert make_trainer(wd).run() == "completed"
        _BUILT["ckpt"] = wd / "ckpt"
    return _BUILT["ckpt"]


def _meta_base() -> dict[str, Any]:
    return json.loads((_checkpoint_template() / "step-6" / "meta.json").read_text())


def _meta_inputs() -> st.SearchStrategy[bytes]:
    return json_mutated(_meta_base())


@given(data=st.deferred(_meta_inputs))
@example(data=b"[" * 100_000 + b"]" * 100_000)  # RecursionError escaped discovery (the trainer's resume)
@example(data=json.dumps({"step": 6, "time": 5, "files": []}).encode())  # a numeric time reached strptime
@example(data=json.dumps({"step": 6, "files": ["a\u0000b"]}).encode())  # a NUL in a file name
@example(data=json.dumps({"step": 6, "files": [], "sizes": {"x\u0000": 1}}).encode())  # ValueError from getsize
@example(data=json.dumps({"step": 6, "files": [], "sizes": {"\r": None}}).encode())  # a CR printed into the line
@example(data=json.dumps({"step": 6, "files": [], "sha256": {"trainer.pt": 5}}).encode())
@example(data=json.dumps({"step": 6, "files": [], "sha256": {"state": "00"}}).encode())  # a folder hashed
@example(data=json.dumps({"step": 6, "files": [], "layout": [1]}).encode())  # layout not an object
def test_fuzz_checkpoint_meta_json(data: bytes) -> None:
    from seqtrain.checkpoint import CheckpointManager
    from seqtrain.checkpoint.discovery import problem, quarantined, read_complete, verify_hashes
    from seqtrain.runtime.dist import DistContext

    work = Path(tempfile.mkdtemp(prefix="seqtrain-fuzz-meta-"))
    try:
        ckpt = work / "ckpt"
        shutil.copytree(_checkpoint_template(), ckpt)
        step = ckpt / "step-6"
        (step / "meta.json").write_bytes(data)
        with bounded("meta.json"):
            why = problem(str(step))
            assert why is None or isinstance(why, str)
            info = read_complete(str(step))
            if info is not None:
                assert info.time is None or isinstance(info.time, str)
                hashed = verify_hashes(str(step))
                assert hashed is None or isinstance(hashed, str)
            latest = CheckpointManager(str(ckpt), keep=3, ctx=DistContext()).latest()
            assert latest is None or latest.step in (4, 6)
            for _, reason in quarantined(str(ckpt)):
                assert "\n" not in reason, reason
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- the JSON files `seqtrain export` / `generate` / `model.init` read --------------------------------------------
def _export_template() -> Path:
    """A seqtrain-format export of the tiny run (model.safetensors + seqtrain.json + config.json)."""
    if "export" not in _BUILT:
        from seqtrain.export.writer import export

        out = Path(tempfile.mkdtemp(prefix="seqtrain-fuzz-export-")) / "model"
        export(str(_checkpoint_template() / "step-6"), str(out), "seqtrain")
        _BUILT["export"] = out
    return _BUILT["export"]


def _export_inputs() -> st.SearchStrategy[tuple[str, bytes]]:
    base = json.loads((_export_template() / "seqtrain.json").read_text())
    meta = _meta_base()
    index = {"weight_map": {"embed.weight": "model.safetensors"}}
    return (st.tuples(st.just("seqtrain.json"), json_mutated(base))
            | st.tuples(st.just("model.safetensors.index.json"), json_mutated(index))
            | st.tuples(st.just("meta.json"), json_mutated(meta)))


@given(case=st.deferred(_export_inputs))
@example(case=("seqtrain.json", b'{"format": "seqtrain", "model": {"arch": "gpt"}, "tokenizer": [1]}'))
@example(case=("seqtrain.json", b'{"format": "seqtrain", "tokenizer": {}}'))  # no model: KeyError escaped
@example(case=("seqtrain.json", b'{"format": "seqtrain", "model": {"arch": "nope"}}'))  # a ValidationError
@example(case=("seqtrain.json", b"[]"))
@example(case=("model.safetensors.index.json", b"[1]"))
@example(case=("meta.json", b'{"step": 6, "files": [], "job": {"spec": 5}}'))
def test_fuzz_model_folder_json(case: tuple[str, bytes]) -> None:
    from seqtrain.export.weights import WeightsError, load_source

    name, data = case
    work = Path(tempfile.mkdtemp(prefix="seqtrain-fuzz-folder-"))
    try:
        if name == "meta.json":
            folder = work / "run" / "ckpt" / "step-6"  # its run folder: empty
            shutil.copytree(_checkpoint_template() / "step-6", folder)
        else:
            folder = work / "model"
            shutil.copytree(_export_template(), folder)
            if name == "model.safetensors.index.json":
                (folder / "model.safetensors").rename(folder / "shard.safetensors")
                (folder / "seqtrain.json").unlink()
        (folder / name).write_bytes(data)
        with bounded(name):
            try:
                load_source(str(folder))
            except WeightsError as exc:
                assert str(exc).strip(), exc
            except CheckpointUnavailable as exc:  # never for a file's content
                pytest.fail(f"a file's content taken for a fault of the moment: {exc}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- token shards, document offsets and the index of `data.source: tokens` ----------------------------------------
def _prepared_template() -> Path:
    if "tokens" not in _BUILT:
        from seqtrain_operator.cli import main as cli_main

        src = Path(tempfile.mkdtemp(prefix="seqtrain-fuzz-tokens-"))
        (src / "a.txt").write_text("first document\n")
        (src / "b.txt").write_text("second document, a little longer\n")
        assert cli_main(["prepare-data", str(src / "a.txt"), str(src / "b.txt"), "--out", str(src / "tok"),
                         "-q"]) == 0
        _BUILT["tokens"] = src / "tok"
    return _BUILT["tokens"]


def _npy_length_fields(data: bytes) -> list[tuple[int, int]]:
    return [(8, 2)]  # the header's declared length (format 1.0)


def _token_inputs() -> st.SearchStrategy[tuple[str, bytes]]:
    folder = _prepared_template()
    index = json.loads((folder / "index.json").read_text())
    docs = (folder / "shard-00000.docs.npy").read_bytes()
    shard = (folder / "shard-00000.bin").read_bytes()
    return (st.tuples(st.just("index.json"), json_mutated(index))
            | st.tuples(st.just("shard-00000.docs.npy"), mutated(docs, _npy_length_fields(docs)))
            | st.tuples(st.just("shard-00000.bin"), mutated(shard)))


def _npy(shape: str, payload: bytes = b"") -> bytes:
    """A .npy file with this shape in its header and `payload` after it (a header may claim any size)."""
    head = f"{{'descr': '<i8', 'fortran_order': False, 'shape': {shape}, }}".encode()
    head += b" " * (63 - (len(head) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") + head + payload


@given(case=st.deferred(_token_inputs))
@example(case=("shard-00000.docs.npy", _npy("(1000000000000,)", (0).to_bytes(8, "little"))))  # 10^12 offsets
@example(case=("shard-00000.docs.npy", _npy("()", (0).to_bytes(8, "little"))))  # a 0-d array
# found by this fuzzer after the fixes above: numpy parses the header as a literal (TokenError, SyntaxError escaped)
@example(case=("shard-00000.docs.npy", b"\x93NUMPY\x01\x00v\x00{'descr': '<i8', 'fortran_order': False( 'shape': "
                                       b"(2,), }" + b" " * 60 + b"\n" + bytes(8) + (16).to_bytes(8, "little")))
@example(case=("shard-00000.docs.npy", b"\x93NUMPY\x01\x00v\x00z'descr': '<i8', 'fortran_order': False, 'shape': "
                                       b"(2,), }" + b" " * 60 + b"\n" + bytes(8) + (16).to_bytes(8, "little")))
@example(case=("index.json", b'{"dtype": "uint16", "shards": [], "vocab_size": "x"}'))  # int("x") escaped
@example(case=("index.json", b'{"dtype": "uint16", "shards": [], "vocab_size": 256, "tokenizer": [[1, 2, 3]]}'))
@example(case=("index.json", b'{"dtype": "uint16", "vocab_size": 256, "shards": [{"name": "a\\u0000", '
                             b'"tokens": 1}]}'))
@example(case=("index.json", b'{"dtype": "uint16", "vocab_size": 256, "shards": '
                             b'[{"name": "shard-00000", "tokens": 1000000000000}]}'))  # 10^12 tokens declared
def test_fuzz_token_files(case: tuple[str, bytes]) -> None:
    from seqtrain.data.tokens import load_prepared, prepared_tokenizer, prepared_vocab

    name, data = case
    work = Path(tempfile.mkdtemp(prefix="seqtrain-fuzz-tok-"))
    try:
        folder = work / "tok"
        shutil.copytree(_prepared_template(), folder)
        (folder / name).write_bytes(data)
        with bounded(name):
            try:
                corpus = load_prepared([str(folder)], None, "train", 0.0)
                prepared_vocab([str(folder)])
                prepared_tokenizer([str(folder)])
            except InvalidConfig as exc:
                _one_line(exc, str(folder))
                return
            except ValueError as exc:  # the loader's own "no documents" error names the spec field
                assert str(exc).startswith("spec.data."), exc
                return
            n = len(corpus.tokens)
            assert n <= os.path.getsize(folder / "shard-00000.bin")  # never more than the shard holds
            corpus.tokens[np.arange(min(n, 64))]
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- tokenizer.json ------------------------------------------------------------------------------------------------
def _tokenizer_json() -> str:
    if "tokenizer" not in _BUILT:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(["hello world, a tiny corpus for a tiny tokenizer"] * 4,
                                trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "<|endoftext|>"]))
        _BUILT["tokenizer"] = tok.to_str()
    return _BUILT["tokenizer"]


def _tokenizer_inputs() -> st.SearchStrategy[bytes]:
    text = _tokenizer_json()
    return json_mutated(json.loads(text)) | mutated(text.encode())


@given(data=st.deferred(_tokenizer_inputs))
@example(data=b'{"model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "[UNK]"}}')
@example(data=b"{" * 100_000)
def test_fuzz_tokenizer_json(data: bytes) -> None:
    from seqtrain.data.sources import FileTokenizer
    from seqtrain.data.tokenizer import read_tokenizer_json

    with tempfile.TemporaryDirectory(prefix="seqtrain-fuzz-tokenizer-") as work:
        path = os.path.join(work, "tokenizer.json")
        with open(path, "wb") as f:
            f.write(data)
        with bounded("tokenizer.json"):
            tok, why = read_tokenizer_json(path)
            assert (tok is None) == bool(why) and "\n" not in why, why
            try:
                file_tok = FileTokenizer(path)
            except InvalidConfig as exc:
                _one_line(exc, "tokenizer.json")
                return
            ids = file_tok.encode("hello world, \u00e9t\u00e9 0")
            file_tok.decode(ids)
