"""`seqtrain prepare-data`: tokenize a corpus into token shards with document boundaries, for `data.source: tokens`.

Output folder:
    index.json                 tokenizer, vocabulary (with the end-of-document id), dtype, shards in order
    plan.json                  the work units and settings (a rerun with other inputs or settings refuses to mix)
    shard-00000.bin            raw little-endian uint16/uint32 tokens; every document ends with the EOD token
    shard-00000.docs.npy       int64 start offset of every document in its shard
    shard-00000.mask.bin       --format chat: one uint8 per token, 1 where the token is the assistant's (scored)
Work is cut into units (text files grouped up to 16 MB, one document per file; a byte range of a jsonl file, cut at line ends; a parquet row group; a row
range of a saved `datasets` dataset). Each unit becomes one shard, written to a temporary name and renamed when
complete, so an interrupted run resumes by skipping the shards that exist; `--workers N` processes units in
parallel. Memory is bounded by one batch of documents per worker (`BATCH_DOCS`, `BATCH_BYTES`) plus one unit's
document offsets:
the corpus is never held in RAM (one text file is one document and is read whole).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

INDEX = "index.json"
PLAN = "plan.json"
BATCH_DOCS = 512  # documents tokenized per batch, at most ...
BATCH_BYTES = 4 << 20  # ... and about this much text (the memory bound of a worker, besides one document itself)
JSONL_UNIT_BYTES = 16 << 20  # jsonl files are cut into ranges of about this size
TEXT_UNIT_BYTES = 16 << 20  # text files are grouped into units of about this size
DATASET_UNIT_ROWS = 50_000
TOKENIZER_COMPANION_MAX_BYTES = 16 << 20  # tokenizer_config.json & co. are kilobytes; anything larger is not one
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|end_of_text|>")


@dataclass(frozen=True)
class Unit:
    kind: str  # text | jsonl | parquet | dataset
    path: str
    start: int = 0  # jsonl: byte offset; parquet: row group; dataset: first row
    stop: int = 0  # jsonl: byte end; dataset: row end
    size: int = 0  # bytes (or rows) for the progress bar
    files: tuple[str, ...] = ()  # text: the files of this unit (small files are grouped, one document each)


class PrepareError(ValueError):
    pass


# ---- tokenizers ---------------------------------------------------------------------------------------------
def tokenizer_file(spec: str) -> str:
    """The tokenizer.json that `--tokenizer` names: the file itself, a Hugging Face model folder holding one (as
    `model.init` takes it), or hf://ORG/NAME[@REVISION] from the local Hugging Face cache."""
    from seqtrain.spec.init_source import HF_SCHEME, local_folder

    path = spec
    if spec.startswith(HF_SCHEME):
        try:
            path = local_folder(spec)
        except ValueError as exc:
            raise PrepareError(f"--tokenizer {exc}") from None
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        inner = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(inner):
            raise PrepareError(f"--tokenizer {spec}: the folder has no tokenizer.json (a Hugging Face model folder "
                               "brings one); give the folder that holds it, a tokenizer.json file, or 'byte'")
        return os.path.abspath(inner)
    if not os.path.isfile(path):
        raise PrepareError(f"--tokenizer: {spec!r} is neither 'byte', a tokenizer.json file, nor a folder holding "
                           "one")
    return os.path.abspath(path)


class _Tok:
    """byte or tokenizer.json, with an end-of-document id (the tokenizer's EOS token, else a new id)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        if spec == "byte":
            self._tok = None
            self.base_vocab, self.eod, self.eod_token = 256, 256, None
        else:
            from seqtrain.data.tokenizer import read_tokenizer_json

            spec = tokenizer_file(spec)
            self.spec = spec
            tok, why = read_tokenizer_json(spec)
            if tok is None:
                raise PrepareError(f"--tokenizer {spec}: {why}; give a Hugging Face tokenizer.json or 'byte'")
            self._tok = tok
            self.base_vocab = self._tok.get_vocab_size(with_added_tokens=True)
            vocab = self._tok.get_vocab(with_added_tokens=True)
            named = [n for n in _EOS_NAMES if n in vocab]
            self.eod_token = named[0] if named else None
            self.eod = vocab[named[0]] if named else self.base_vocab
        self.vocab_size = max(self.base_vocab, self.eod + 1)
        self.dtype = np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        if self._tok is None:
            return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), dtype=np.uint8) for t in texts]
        strs = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        try:
            encoded = self._tok.encode_batch(strs, add_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise PrepareError(f"--tokenizer {self.spec}: cannot encode the text "
                               f"({str(exc).splitlines()[0][:160]})") from None
        return [np.asarray(e.ids, dtype=self.dtype) for e in encoded]

    def describe(self, out_dir: str) -> dict[str, Any]:
        if self._tok is None:
            return {"type": "byte", "eod": self.eod}
        return {"type": "file", "path": os.path.join(os.path.abspath(out_dir), "tokenizer.json"), "eod": self.eod,
                "eod_token": self.eod_token}


# ---- inputs -> units ----------------------------------------------------------------------------------------
def _is_dataset_dir(path: str) -> bool:
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_info.json"))
                                    or os.path.isfile(os.path.join(path, "dataset_dict.json"))
                                    or os.path.isfile(os.path.join(path, "state.json")))


def _jsonl_ranges(path: str) -> list[tuple[int, int]]:
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + JSONL_UNIT_BYTES < size:
            f.seek(cuts[-1] + JSONL_UNIT_BYTES)
            f.readline()  # to the next line end
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def plan_units(inputs: Sequence[str], text_field: str) -> list[Unit]:
    units: list[Unit] = []
    texts: list[tuple[str, int]] = []

    def close_texts() -> None:
        if texts:
            units.append(Unit("text", texts[0][0], 0, 0, sum(s for _, s in texts), tuple(p for p, _ in texts)))
            texts.clear()

    for pattern in inputs:
        path = os.path.expanduser(pattern)
        if _is_dataset_dir(path):
            ds = _load_dataset(path, text_field)
            n = len(ds)
            close_texts()
            units += [Unit("dataset", os.path.abspath(path), a, min(n, a + DATASET_UNIT_ROWS),
                           min(n, a + DATASET_UNIT_ROWS) - a) for a in range(0, n, DATASET_UNIT_ROWS)]
            continue
        if os.path.isdir(path):
            matches = sorted(p for p in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(p))
        else:
            matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not matches:
            raise PrepareError(f"INPUT {pattern!r} matches no file or dataset folder")
        for p in matches:
            p = os.path.abspath(p)
            if p.endswith((".jsonl", ".json.l", ".ndjson")):
                close_texts()
                units += [Unit("jsonl", p, a, b, b - a) for a, b in _jsonl_ranges(p)]
            elif p.endswith(".parquet"):
                close_texts()
                import pyarrow.parquet as pq

                meta = pq.ParquetFile(p).metadata
                units += [Unit("parquet", p, g, g + 1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
            else:
                size = os.path.getsize(p)
                if texts and sum(s for _, s in texts) + size > TEXT_UNIT_BYTES:
                    close_texts()
                texts.append((p, size))
    close_texts()
    return units


def _load_dataset(path: str, text_field: str):  # noqa: ANN202 - datasets.Dataset
    try:
        import datasets
    except ImportError as exc:
        raise PrepareError(f"{path}: a saved `datasets` dataset needs the datasets package "
                           "(pip install 'seqtrain[data]')") from exc
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise PrepareError(f"{path}: a DatasetDict without a 'train' split ({', '.join(ds)}); save one split")
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise PrepareError(f"{path}: no column {text_field!r} (columns: {', '.join(ds.column_names)}); use --field")
    return ds


def _texts(unit: Unit, field: str) -> Iterator[str | bytes]:
    if unit.kind == "text":
        for path in unit.files:
            with open(path, "rb") as f:
                yield f.read()  # bytes: the byte tokenizer takes them as they are
    elif unit.kind == "jsonl":
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            pos, lineno = unit.start, 0
            while pos < unit.stop:
                line = f.readline()
                if not line:
                    break
                pos += len(line)
                lineno += 1
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as exc:
                    raise PrepareError(f"{unit.path} (byte {pos - len(line)}): not valid JSON ({exc})") from None
                value = rec.get(field) if isinstance(rec, dict) else None
                if not isinstance(value, str):
                    raise PrepareError(f"{unit.path} (byte {pos - len(line)}): no string field {field!r}; use --field")
                yield value
    elif unit.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.path)
        if field not in pf.schema_arrow.names:
            raise PrepareError(f"{unit.path}: no column {field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                               "use --field")
        kind = pf.schema_arrow.field(field).type
        import pyarrow as pa

        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_large_binary(kind)):
            raise PrepareError(f"{unit.path}: column {field!r} holds {kind}, not text; name the text column with "
                               "--field")
        for batch in pf.iter_batches(batch_size=BATCH_DOCS, row_groups=[unit.start], columns=[field]):
            yield from (t for t in batch.column(0).to_pylist() if t)
    elif unit.kind == "dataset":
        ds = _load_dataset(unit.path, field)
        for a in range(unit.start, unit.stop, BATCH_DOCS):
            for t in ds[a:min(unit.stop, a + BATCH_DOCS)][field]:
                if t and not isinstance(t, str | bytes):
                    raise PrepareError(f"{unit.path}: column {field!r} holds {type(t).__name__} values, not text; "
                                       "name the text column with --field")
                if t:
                    yield t


# ---- one unit -> one shard ----------------------------------------------------------------------------------
def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def _chat_records(unit: Unit, field: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(where, checked messages) of each line of a jsonl unit (--format chat)."""
    from seqtrain.data.chat import check_messages

    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        pos = unit.start
        while pos < unit.stop:
            line = f.readline()
            if not line:
                break
            where = f"{unit.path} (byte {pos})"
            pos += len(line)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as exc:
                raise PrepareError(f"{where}: not valid JSON ({str(exc).splitlines()[0][:120]})") from None
            if not isinstance(rec, dict) or field not in rec:
                raise PrepareError(f"{where}: no field {field!r} (--format chat reads each line's list of "
                                   "{role, content} messages; name another with --field)")
            yield where, check_messages(rec[field], where)


def _process_chat(i: int, unit: Unit, tok: _Tok, field: str, out: str) -> tuple[int, int, int]:
    """One jsonl unit of conversations -> its shard and its assistant mask (every document ends with EOD, unscored)."""
    from seqtrain.data.chat import ChatEncoder

    if tok._tok is None:
        raise PrepareError("--format chat needs --tokenizer: a Hugging Face folder (or tokenizer.json) whose folder "
                           "holds a chat template")
    enc = ChatEncoder(tok._tok, tok.spec)
    base = os.path.join(out, shard_name(i))
    starts: list[int] = []
    n = 0
    eod = np.array([tok.eod], dtype=tok.dtype)
    with open(base + ".bin.tmp", "wb") as f, open(base + ".mask.bin.tmp", "wb") as fm:
        for where, messages in _chat_records(unit, field):
            ids, mask = enc.encode(messages, where, tok.dtype)
            if len(ids) < 2 or not mask[1:].any():
                continue
            starts.append(n)
            f.write(ids.tobytes())
            f.write(eod.tobytes())
            fm.write(mask.astype(np.uint8).tobytes())
            fm.write(b"\0")
            n += len(ids) + 1
        for fh in (f, fm):
            fh.flush()
            os.fsync(fh.fileno())
    np.save(base + ".docs.tmp.npy", np.asarray(starts, dtype=np.int64))
    os.replace(base + ".docs.tmp.npy", base + ".docs.npy")
    os.replace(base + ".mask.bin.tmp", base + ".mask.bin")
    os.replace(base + ".bin.tmp", base + ".bin")  # last: a .bin means the shard is complete
    return i, n, len(starts)


def _process(args: tuple[int, Unit, str, str, str, str]) -> tuple[int, int, int]:
    """Tokenize one unit into its shard (atomic rename); returns (unit index, tokens, documents)."""
    i, unit, tok_spec, field, out, fmt = args
    tok = _tok_cache(tok_spec)
    if fmt == "chat":
        from seqtrain.data.chat import ChatDataError

        try:
            return _process_chat(i, unit, tok, field, out)
        except ChatDataError as exc:  # the spec's field name means nothing here: the option's does
            raise PrepareError(str(exc).replace("spec.data.format: chat", "--format chat")) from None
    base = os.path.join(out, shard_name(i))
    tmp = base + ".bin.tmp"
    starts: list[int] = []
    n = 0
    eod = np.array([tok.eod], dtype=tok.dtype)
    with open(tmp, "wb") as f:
        batch: list[str | bytes] = []

        def flush() -> None:
            nonlocal n
            for ids in tok.encode_batch(batch):
                if len(ids) == 0:
                    continue
                starts.append(n)
                f.write(ids.astype(tok.dtype, copy=False).tobytes())
                f.write(eod.tobytes())
                n += len(ids) + 1
            batch.clear()

        size = 0
        for text in _texts(unit, field):
            batch.append(text)
            size += len(text)
            if len(batch) >= BATCH_DOCS or size >= BATCH_BYTES:
                flush()
                size = 0
        flush()
        f.flush()
        os.fsync(f.fileno())
    np.save(base + ".docs.tmp.npy", np.asarray(starts, dtype=np.int64))
    os.replace(base + ".docs.tmp.npy", base + ".docs.npy")
    os.replace(tmp, base + ".bin")  # last: a .bin means the shard is complete
    return i, n, len(starts)


_TOKS: dict[str, _Tok] = {}


def _tok_cache(spec: str) -> _Tok:
    if spec not in _TOKS:
        _TOKS[spec] = _Tok(spec)
    return _TOKS[spec]


# ---- the command --------------------------------------------------------------------------------------------
def _fingerprint(units: list[Unit], tok: _Tok, field: str, fmt: str = "text") -> str:
    h = hashlib.sha256()
    h.update(json.dumps([asdict(u) for u in units], sort_keys=True).encode())
    h.update(f"{tok.spec}|{tok.eod}|{tok.vocab_size}|{field}".encode())
    if fmt != "text":  # the text format's fingerprint is what it always was: earlier runs still resume
        h.update(f"|{fmt}".encode())
    if tok.spec != "byte":
        with open(tok.spec, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


_OWN_FILE = re.compile(r"^(shard-\d{5}(\.bin|\.docs\.npy|\.bin\.tmp|\.docs\.tmp\.npy|\.mask\.bin(\.tmp)?)"
                       r"|plan\.json(\.tmp)?"
                       r"|index\.json(\.tmp)?|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json"
                       r"|chat_template\.jinja)$")


def _own_files(out: str) -> list[str]:
    """The files an earlier prepare-data wrote into out (what --overwrite removes; nothing else is touched)."""
    return sorted(os.path.join(out, f) for f in os.listdir(out) if _OWN_FILE.match(f))


def prepare(inputs: Sequence[str], out: str, tokenizer: str = "byte", workers: int = 1, field: str = "text",
            progress: bool = True, overwrite: bool = False, fmt: str = "text") -> dict[str, Any]:
    """Tokenize `inputs` into `out`; resumes a previous run with the same inputs and settings. A folder holding
    another run's shards is refused unless `overwrite`, which first removes that run's files (only those). A
    folder whose earlier run wrote its plan but no shard (it failed first) is simply re-planned. Returns the
    index (also written to out/index.json) plus timing."""
    t0 = time.perf_counter()
    tok = _tok_cache(tokenizer)
    if fmt not in ("text", "chat"):
        raise PrepareError(f"--format {fmt!r}: use text or chat")
    if fmt == "chat" and field == "text":
        field = "messages"  # the default field of chat records
    units = plan_units(inputs, field)
    if not units:
        raise PrepareError("no input units")
    if fmt == "chat":
        if tok.spec == "byte":
            raise PrepareError("--format chat needs --tokenizer: a Hugging Face folder (or its tokenizer.json) with a "
                               "chat template")
        from seqtrain.data.chat import ChatDataError, find_template

        try:
            find_template(tok.spec)
        except ChatDataError as exc:
            raise PrepareError(str(exc).replace("spec.data.format: chat", "--format chat")) from None
        if other := [u.path for u in units if u.kind != "jsonl"]:
            raise PrepareError(f"--format chat reads .jsonl files of messages; {other[0]} is not one")
    os.makedirs(out, exist_ok=True)
    fp = _fingerprint(units, tok, field, fmt)
    plan_path = os.path.join(out, PLAN)
    if overwrite:
        for f in _own_files(out):
            os.remove(f)
    old: dict[str, Any] = {}
    if os.path.isfile(plan_path):
        try:
            with open(plan_path, encoding="utf-8") as f:
                old = json.load(f)
        except ValueError:
            old = {}
        old = old if isinstance(old, dict) else {}
        shards = [f for f in os.listdir(out) if re.fullmatch(r"shard-\d{5}\.bin", f)]
        if old.get("fingerprint") != fp and shards:
            raise PrepareError(f"--out {out}: holds {len(shards)} shard(s) of other inputs or settings (plan.json "
                               "differs); add --overwrite to replace them, or use an empty folder")
    if old.get("fingerprint") != fp:
        with open(plan_path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"fingerprint": fp, "field": field, "tokenizer": tokenizer,
                       "units": [asdict(u) for u in units]}, f, indent=1)
        os.replace(plan_path + ".tmp", plan_path)
    if tok.spec != "byte":
        import shutil

        from seqtrain.spec.init_source import TOKENIZER_COMPANIONS

        shutil.copyfile(tok.spec, os.path.join(out, "tokenizer.json"))
        for name in TOKENIZER_COMPANIONS:  # special tokens and chat template travel with the tokenizer
            src = os.path.join(os.path.dirname(tok.spec), name)
            if os.path.isfile(src) and os.path.getsize(src) <= TOKENIZER_COMPANION_MAX_BYTES:
                shutil.copyfile(src, os.path.join(out, name))
    done = {i for i in range(len(units)) if os.path.isfile(os.path.join(out, shard_name(i) + ".bin"))}
    todo = [i for i in range(len(units)) if i not in done]
    jobs = [(i, units[i], tokenizer, field, out, fmt) for i in todo]
    results: dict[int, tuple[int, int]] = {}
    total = sum(u.size for u in units)
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("prepare-data"), BarColumn(), TaskProgressColumn(), TextColumn("{task.fields[info]}"),
                  TimeRemainingColumn(), disable=not progress, transient=False) as bar:
        task = bar.add_task("units", total=total, info="", completed=sum(units[i].size for i in done))
        tokens_new = 0

        def record(res: tuple[int, int, int]) -> None:
            nonlocal tokens_new
            i, n, docs = res
            results[i] = (n, docs)
            tokens_new += n
            rate = tokens_new / max(1e-9, time.perf_counter() - t0)
            bar.update(task, advance=units[i].size, info=f"{len(results) + len(done)}/{len(units)} shards, "
                                                           f"{rate / 1e6:.2f}M tok/s")

        if workers > 1 and len(jobs) > 1:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(workers) as pool:
                for res in pool.imap_unordered(_process, jobs):
                    record(res)
        else:
            for job in jobs:
                record(_process(job))
    shards = []
    for i, u in enumerate(units):
        base = os.path.join(out, shard_name(i))
        n = os.path.getsize(base + ".bin") // tok.dtype.itemsize
        docs = int(np.load(base + ".docs.npy", mmap_mode="r").shape[0])
        shards.append({"name": shard_name(i), "tokens": int(n), "documents": docs, "source": u.path,
                       "kind": u.kind})
    index = {"format": "seqtrain-tokens", "version": 1, "dtype": tok.dtype.name, "vocab_size": tok.vocab_size,
             "eod": tok.eod, "tokenizer": tok.describe(out), "shards": shards,
             "tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards)}
    if fmt == "chat":  # shard-N.mask.bin beside each shard: which tokens are scored
        index["format"], index["loss_mask"] = "chat", True
    with open(os.path.join(out, INDEX + ".tmp"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
    os.replace(os.path.join(out, INDEX + ".tmp"), os.path.join(out, INDEX))
    seconds = time.perf_counter() - t0
    return {**index, "seconds": seconds, "resumed_shards": len(done), "new_tokens": sum(n for n, _ in results.values())}


def prepare_command(inputs: Sequence[str], out: str, tokenizer: str, workers: int, field: str,
                    quiet: bool = False, overwrite: bool = False, fmt: str = "text") -> int:
    try:
        info = prepare(inputs, out, tokenizer, workers, field, progress=not quiet and sys.stderr.isatty(),
                       overwrite=overwrite, fmt=fmt)
    except (PrepareError, OSError) as exc:
        print(f"seqtrain prepare-data: {exc}", file=sys.stderr)
        return 2
    rate = info["new_tokens"] / info["seconds"] if info["seconds"] else 0.0
    again = f", {info['resumed_shards']} shard(s) kept from an earlier run" if info["resumed_shards"] else ""
    print(f"{out}: {info['tokens']:,} tokens in {info['documents']:,} documents, {len(info['shards'])} shard(s), "
          f"vocab {info['vocab_size']} (end-of-document id {info['eod']}); {info['seconds']:.1f}s, "
          f"{rate / 1e6:.2f}M tokens/s{again}")
    if any(round(sh["documents"] * 0.01) == 0 for sh in info["shards"]):  # the default validationFraction
        print(f"{out}: a shard with fewer documents than a job's validationFraction can hold out (under 50 at "
              "1%) gives the last validationFraction of its tokens to validation instead")
    return 0
