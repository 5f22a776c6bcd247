"""Byte-level tokenizer: UTF-8 bytes are the token ids (vocabulary 256, no unknown tokens)."""

from __future__ import annotations

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
