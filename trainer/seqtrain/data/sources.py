"""Data sources beyond the built-in corpus: text files, jsonl, pre-tokenized token files; tokenizer.json.

Every source returns a `Corpus` (all documents of one split concatenated, plus where each starts), so batching,
packing and sharding are the same for all of them. The validation split is `data.validation` when named (then all
of `data.paths` trains); otherwise it is deterministic: per document by a hash of its name (text: the path; jsonl:
path and line number); token files keep their last `validationFraction` of tokens for validation (the rules in
`seqtrain.spec.datafiles`, which `validate` checks).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from seqtrain.data.builtin import Corpus
from seqtrain.data.tokenizer import ByteTokenizer, read_tokenizer_json
from seqtrain.runtime.exitcodes import InvalidConfig
from seqtrain.spec.data import DataSpec
from seqtrain.spec.datafiles import expand, in_validation

EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eot_id|>")


class TokenizerFileError(InvalidConfig, ValueError):
    """A tokenizer file that cannot be read: invalid input (the trainer exits 3, the CLI commands 2)."""


class FileTokenizer:
    """A local `tokenizer.json` (Hugging Face `tokenizers`): no network, ids as uint16/uint32 arrays."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"spec.data.tokenizer.path: {path!r} is not a file")
        self.path = path
        tok, why = read_tokenizer_json(path)
        if tok is None:
            raise TokenizerFileError(f"spec.data.tokenizer.path: {path}: {why}; give a Hugging Face tokenizer.json")
        self._tok = tok
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # the end-of-document token placed between text/jsonl documents (None: the tokenizer has none)
        self.eos_id: int | None = next((vocab[t] for t in EOS_TOKENS if t in vocab), None)

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def id_to_token(self, i: int) -> str | None:
        """The token string of id `i` (None outside the file's vocabulary): for messages naming a token."""
        return self._tok.id_to_token(i)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=self.dtype)
                for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Any) -> str:
        return self._tok.decode([int(i) for i in ids])


Tokenizer = ByteTokenizer | FileTokenizer


def build_tokenizer(spec: DataSpec) -> Tokenizer:
    if spec.tokenizer.type == "byte":
        return ByteTokenizer()
    if not spec.tokenizer.path:
        raise ValueError("spec.data.tokenizer.path: type file needs the path of a tokenizer.json")
    return FileTokenizer(os.path.expanduser(spec.tokenizer.path))


def expand_paths(patterns: Sequence[str], field: str = "spec.data.paths", folders: bool = True) -> list[str]:
    """Sorted, de-duplicated files matched by the globs (`**` recursive) or below the folders; error naming the
    pattern if none (the rule `validate` applies too: `seqtrain.spec.datafiles.expand`)."""
    return expand(patterns, field, folders)


def corpus_from_documents(docs: Sequence[np.ndarray], dtype: Any = None) -> Corpus:
    docs = [d for d in docs if len(d)]
    if not docs:
        raise ValueError("the data source produced no non-empty documents for this split")
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    tokens = np.concatenate(docs).astype(dtype or docs[0].dtype, copy=False)
    return Corpus(tokens=tokens, doc_starts=starts)


def _encode_all(tok: Tokenizer, texts: list[bytes]) -> list[np.ndarray]:
    if isinstance(tok, FileTokenizer):
        return tok.encode_batch([t.decode("utf-8", errors="replace") for t in texts])
    return [tok.encode(t) for t in texts]


def _documents(tok: Tokenizer, texts: list[bytes]) -> list[np.ndarray]:
    """Each text/jsonl document encoded and ended with the tokenizer's end-of-document id, so a model trained
    on the concatenation (packing off) learns where documents end instead of reading one into the next."""
    docs = _encode_all(tok, texts)
    eos = tok.eos_id
    if eos is None:
        return docs
    return [np.append(d, np.asarray(eos, dtype=d.dtype)) if len(d) else d for d in docs]


def load_text(spec: DataSpec, split: str, tok: Tokenizer) -> Corpus:
    texts: list[bytes] = []
    for path in expand_paths(spec.paths):
        if in_validation(path, spec.validation_fraction) != (split == "validation"):
            continue
        with open(path, "rb") as f:
            texts.append(f.read())
    if not texts:
        raise ValueError(f"spec.data.paths: no file falls into the {split} split "
                         f"(validationFraction {spec.validation_fraction}, per file by a hash of its path); name "
                         "held-out files in data.validation, or add files")
    return corpus_from_documents(_documents(tok, texts))


def _jsonl_records(path: str, field: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict) or field not in rec:
                raise ValueError(f"{path}:{lineno}: no field {field!r}; set spec.data.jsonlField to the text field")
            value = rec[field]
            if not isinstance(value, str):
                raise ValueError(f"{path}:{lineno}: field {field!r} is {type(value).__name__}, not a string")
            yield lineno, value


def load_chat(spec: DataSpec, split: str, tok: Tokenizer) -> Corpus:
    """data.format chat: each jsonl line's messages through the chat template; only assistant tokens are scored
    (`Corpus.loss_mask`), one conversation per document (the template ends each turn: no end-of-document id)."""
    from seqtrain.data.chat import ChatDataError, ChatEncoder, chat_records

    if not isinstance(tok, FileTokenizer):
        raise ChatDataError("spec.data.format: chat needs a tokenizer with a chat template (a model.init folder's, "
                            "or data.tokenizer {type: file, path: .../tokenizer.json}), not byte-level ids")
    enc = ChatEncoder(tok._tok, tok.path)
    docs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    want_val = split == "validation"
    for path in expand_paths(spec.paths):
        for lineno, messages in chat_records(path):
            if in_validation(f"{path}:{lineno}", spec.validation_fraction) != want_val:
                continue
            ids, mask = enc.encode(messages, f"{path}:{lineno}", tok.dtype)
            if len(ids) >= 2 and mask[1:].any():  # something to predict (an assistant token after the first)
                docs.append(ids)
                masks.append(mask)
    if not docs:
        raise ValueError(f"spec.data.paths: no chat record with an assistant turn falls into the {split} split")
    corpus = corpus_from_documents(docs)
    return Corpus(tokens=corpus.tokens, doc_starts=corpus.doc_starts, loss_mask=np.concatenate(masks))


def load_jsonl(spec: DataSpec, split: str, tok: Tokenizer) -> Corpus:
    if spec.format == "chat":
        return load_chat(spec, split, tok)
    texts: list[bytes] = []
    want_val = split == "validation"
    for path in expand_paths(spec.paths):
        for lineno, text in _jsonl_records(path, spec.jsonl_field):
            if in_validation(f"{path}:{lineno}", spec.validation_fraction) == want_val:
                texts.append(text.encode("utf-8"))
    if not texts:
        raise ValueError(f"spec.data.paths: no jsonl record falls into the {split} split")
    return corpus_from_documents(_documents(tok, texts))


class ConcatTokens:
    """Several memory-mapped token files seen as one 1-D array (fancy indexing reads only what is asked)."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = list(parts)
        self.offsets = np.concatenate(([0], np.cumsum([len(p) for p in self.parts]))).astype(np.int64)
        self.dtype = self.parts[0].dtype
        self.shape = (int(self.offsets[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: Any) -> np.ndarray:
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(len(self)))
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError("token index out of range")
        flat = idx.reshape(-1)
        part = np.searchsorted(self.offsets, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for p in np.unique(part):
            sel = part == p
            out[sel] = self.parts[p][flat[sel] - self.offsets[p]]
        return out.reshape(idx.shape)


def load_tokens(spec: DataSpec, split: str) -> Corpus:
    """Pre-tokenized files (raw little-endian uint16/uint32, e.g. nanoGPT's train.bin), memory-mapped.

    Each file is one document; the validation split is the last `validationFraction` of every file.
    """
    dtype = np.dtype(spec.token_dtype)
    parts: list[np.ndarray] = []
    for path in expand_paths(spec.paths, folders=False):
        size = os.path.getsize(path)
        if size % dtype.itemsize:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {spec.token_dtype} tokens; "
                             "check spec.data.tokenDtype")
        n = size // dtype.itemsize
        if n < 2:
            continue
        mm = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
        cut = n - int(round(n * spec.validation_fraction))
        part = mm[:cut] if split == "train" else mm[cut:]
        if len(part) >= 2:
            parts.append(part)
    if not parts:
        raise ValueError(f"spec.data.paths: the token files hold no {split} tokens")
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    tokens = parts[0] if len(parts) == 1 else ConcatTokens(parts)
    return Corpus(tokens=tokens, doc_starts=starts)  # type: ignore[arg-type]


def max_token_id(corpus: Corpus, sample: int = 1 << 20) -> int:
    """Largest id in (a prefix of) the corpus: a cheap guard against a vocabulary smaller than the data."""
    n = min(len(corpus), sample)
    return int(np.asarray(corpus.tokens[np.arange(n)]).max()) if n else 0


def whole_split(spec: DataSpec, split: str) -> DataSpec:
    """With data.validation named, each split is the whole of its own list: a copy of spec whose paths are that
    list and whose validationFraction is 0 (so the loaders below hold nothing out), to be read as "train"."""
    paths = spec.validation if split == "validation" else spec.paths
    return spec.model_copy(update={"paths": list(paths or []), "validation_fraction": 0.0,
                                   "weights": spec.weights if split == "train" else None, "validation": None})


def load_source(spec: DataSpec, split: str, seed: int = 0) -> Corpus:
    """The corpus of one split for any `data.source` (the builtin corpus re-encoded with a tokenizer.json)."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be train or validation, not {split!r}")
    if spec.validation and spec.source in ("text", "jsonl", "tokens"):
        return load_source(whole_split(spec, split), "train", seed)
    if spec.source == "synthetic":
        from seqtrain.data.synthetic import load_synthetic

        return load_synthetic(spec.synthetic, split, seed)
    if spec.source == "tokens":
        from seqtrain.data.tokens import is_prepared, load_prepared

        prepared = [is_prepared(p) for p in spec.paths]
        if all(prepared):
            return load_prepared(spec.paths, spec.weights, split, spec.validation_fraction, seed)
        if any(prepared):
            raise ValueError("spec.data.paths: mixes `seqtrain prepare-data` folders and raw token files; prepare "
                             "the raw files too (or list only one kind)")
        if spec.weights is not None:
            raise ValueError("spec.data.weights: blending needs `seqtrain prepare-data` folders in data.paths")
        return load_tokens(spec, split)
    tok = build_tokenizer(spec)
    if spec.source == "text":
        return load_text(spec, split, tok)
    if spec.source == "jsonl":
        return load_jsonl(spec, split, tok)
    if spec.source == "builtin":
        from seqtrain.data.builtin import load_builtin

        raw = load_builtin(split, spec.validation_fraction)
        if isinstance(tok, ByteTokenizer):
            return raw
        bounds = np.append(raw.doc_starts, len(raw))
        texts = [raw.tokens[a:b].tobytes() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return corpus_from_documents(_encode_all(tok, texts))
    raise ValueError(f"spec.data.source: unknown source {spec.source!r}")
