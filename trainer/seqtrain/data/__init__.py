"""Data: corpora, tokenizers and resumable rank-sharded batches. `build_train_data(job, ...)` is the entry."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from seqtrain.data.builtin import Corpus, load_builtin
from seqtrain.data.tokenizer import ByteTokenizer
from seqtrain.spec.job import SeqTrainJob

if TYPE_CHECKING:
    from seqtrain.data.batches import IGNORE_INDEX, Batch, SequenceBatches, eval_batches, window_batch
    from seqtrain.data.packing import DocumentBatches

# The torch-based batchers load on first use, so torch-free tools in this package (`seqtrain prepare-data`,
# `seqtrain.data.prepare`) do not pay torch's import (about 600 MB of resident memory).
_LAZY = {"IGNORE_INDEX": "batches", "Batch": "batches", "SequenceBatches": "batches", "eval_batches": "batches",
         "window_batch": "batches", "DocumentBatches": "packing"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "IGNORE_INDEX", "Batch", "ByteTokenizer", "Corpus", "DocumentBatches", "SequenceBatches", "build_train_data", "eval_batches",
    "load_builtin", "load_corpus", "window_batch",
]


def load_corpus(job: SeqTrainJob, split: str) -> Corpus:
    d = job.spec.data
    if d.source == "builtin" and d.tokenizer.type == "byte":
        return load_builtin(split, d.validation_fraction)
    from seqtrain.data.sources import load_source  # text, jsonl, token files, synthetic tasks, tokenizer.json

    return load_source(d, split, job.spec.training.seed)


def build_train_data(job: SeqTrainJob, dp_rank: int, dp_size: int) -> SequenceBatches | DocumentBatches:
    from seqtrain.data.batches import SequenceBatches
    from seqtrain.data.packing import DocumentBatches

    s = job.spec
    corpus = load_corpus(job, "train")
    common = dict(
        seq_len=s.data.seq_len,
        micro_batch_size=s.training.micro_batch_size,
        grad_accum=max(1, s.training.global_batch_size // (s.training.micro_batch_size * dp_size)),
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=s.training.seed,
        shuffle=s.data.shuffle,
    )
    if s.data.packing or s.data.bucketing or s.data.max_tokens_per_batch or corpus.loss_mask is not None:
        # Document-aware rows (packing / one document per row); synthetic tasks always (only answers are scored).
        return DocumentBatches(corpus, packing=s.data.packing, bucketing=s.data.bucketing,
                               max_tokens_per_batch=s.data.max_tokens_per_batch, **common)
    return SequenceBatches(corpus, **common)
