"""`spec.data`: where tokens come from and how they are batched."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from seqtrain.spec.base import MAX_SEQ_LEN, SpecModel


class TokenizerSpec(SpecModel):
    type: Literal["byte", "file"] = Field("byte", description="byte: raw UTF-8 bytes (vocab 256); file: a tokenizer.json.")
    path: str | None = Field(None, description="Path of a local tokenizer.json (type: file).")


class SyntheticSpec(SpecModel):
    task: Literal["copy", "recall"] = Field("copy", description="copy: repeat a random string; recall: associative recall.")
    length: int = Field(32, ge=2, le=65536, description="Length of the random part of each example.")
    vocab: int = Field(32, ge=4, le=65536, description="Number of distinct symbols the task draws from.")


class DataSpec(SpecModel):
    source: Literal["builtin", "text", "jsonl", "tokens", "synthetic"] = Field(
        "builtin",
        description="builtin: the running Python's standard-library sources (no network); text: files by glob; "
        "jsonl: one field of each line (text and jsonl are read into memory: small corpora); tokens: folders "
        "written by `seqtrain prepare-data` (memory-mapped, with document boundaries) or raw token files; "
        "synthetic: generated tasks.",
    )
    paths: list[str] = Field(
        default_factory=list, description="Files or globs (text, jsonl, tokens); for tokens also folders written by "
        "`seqtrain prepare-data` (one dataset each).")
    validation: list[str] | None = Field(
        None, description="Validation data named explicitly: files, globs or folders of the same kind as paths (for "
        "tokens: `seqtrain prepare-data` folders or raw token files such as nanoGPT's val.bin). Then nothing of "
        "paths is held out, and an entry that is also training data is refused. Default: a validationFraction "
        "of paths.")
    weights: list[float] | None = Field(
        None, description="Blend weights, one per entry of paths (source tokens with prepare-data folders): each "
        "dataset's share of the training tokens. Default: every document once.")
    jsonl_field: str = Field("text", description="Which field of each jsonl line holds the text.")
    format: Literal["text", "chat"] = Field(
        "text", description="text: each document is plain text, every token scored. chat (source jsonl): each line "
        "is {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}, rendered with the tokenizer folder's chat "
        "template (chat_template in tokenizer_config.json or chat_template.jinja beside tokenizer.json) and scored "
        "only on the assistant turns.")
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of pre-tokenized files.")
    synthetic: SyntheticSpec = Field(default_factory=SyntheticSpec, description="Settings of source: synthetic.")
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec, description="How text becomes token ids.")
    seq_len: int = Field(256, ge=2, le=MAX_SEQ_LEN, description="Tokens per training sequence (context length).")
    validation_fraction: float = Field(
        0.01, ge=0.0, lt=0.5, description="Share of paths held out for validation when data.validation is not set "
        "(deterministic): text files by a hash of their path, jsonl records by path and line, the last share of each "
        "raw token file, the last documents of each prepared shard (its last tokens when it has too few documents)."
    )
    packing: bool = Field(
        False, description="Pack several documents per sequence; attention and recurrent state never cross documents."
    )
    bucketing: bool = Field(False, description="Group documents of similar length into the same batch.")
    max_tokens_per_batch: int | None = Field(
        None, ge=1, le=2**30, description="Token budget per micro-batch (variable batch size); default: fixed micro-batch size."
    )
    shuffle: bool = Field(True, description="Shuffle the order of sequences each epoch (seeded, resumable).")
