"""Tokenizers: the byte-level one (UTF-8 bytes are the token ids, vocabulary 256) and the reader of tokenizer.json files."""

from __future__ import annotations

from typing import Any

import numpy as np


class ByteTokenizer:
    vocab_size = 256
    # End of document between text/jsonl documents: NUL, the one byte that does not occur in text files (the
    # 256 ids are all bytes, so there is no spare id; a tokenizer.json brings its own end-of-text token).
    eos_id: int | None = 0

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, ids) -> str:  # noqa: ANN001 - any int sequence, array or tensor
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


TOKENIZER_MAX_BYTES = 1 << 30  # the largest vocabularies' tokenizer.json are tens of MiB


def read_tokenizer_json(path: str) -> tuple[Any, str]:
    """`tokenizers.Tokenizer.from_file(path)`, or (None, why) for a missing or unreadable file: the callers name
    their own field (`--tokenizer`, spec.data.tokenizer.path) and exit code around `why`."""
    import os

    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        return None, "is not a file"
    if os.path.getsize(path) > TOKENIZER_MAX_BYTES:  # read whole by the library: not a file of any size
        return None, f"larger than {TOKENIZER_MAX_BYTES >> 20} MiB, not a tokenizer.json"
    try:
        tok = Tokenizer.from_file(path)
    except BaseException as exc:  # noqa: BLE001 - a bare Exception for a bad file; a panic is pyo3's BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit | MemoryError):
            raise
        return None, f"not a tokenizer.json the `tokenizers` library reads ({_first_line(exc)})"
    unk = getattr(tok.model, "unk_token", None)
    if isinstance(unk, str) and unk and tok.token_to_id(unk) is None:
        # encoding any word outside the vocabulary would raise "Missing [UNK] token from the vocabulary"
        return None, (f"its unknown-word token {unk!r} is not in its vocabulary, so text with any other word "
                      "cannot be encoded; add the token to the vocabulary (or train the tokenizer with it as a "
                      "special token)")
    try:  # a file the library reads may still fail on use (a panic inside it): find out here, not mid-run
        tok.decode(tok.encode("seqtrain 0 \u00e9\n", add_special_tokens=False).ids)
    except BaseException as exc:  # noqa: BLE001 - as above
        if isinstance(exc, KeyboardInterrupt | SystemExit | MemoryError):
            raise
        return None, f"the `tokenizers` library reads it but cannot encode text with it ({_first_line(exc)})"
    return tok, ""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
