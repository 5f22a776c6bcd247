"""Data: corpora, tokenizers and resumable rank-sharded batches. `build_train_data(job, ...)` is the entry."""

from __future__ import annotations

from seqtrain.spec.job import SeqTrainJob

from .batches import IGNORE_INDEX, Batch, SequenceBatches, eval_batches, window_batch
from .builtin import Corpus, load_builtin
from .tokenizer import ByteTokenizer

__all__ = [
    "IGNORE_INDEX", "Batch", "ByteTokenizer", "Corpus", "SequenceBatches", "build_train_data", "eval_batches",
    "load_builtin", "load_corpus", "window_batch",
]


def load_corpus(job: SeqTrainJob, split: str) -> Corpus:
    d = job.spec.data
    if d.source == "builtin":
        return load_builtin(split, d.validation_fraction)
    raise ValueError(f"spec.data.source: {d.source!r} is not available yet; use builtin")


def build_train_data(job: SeqTrainJob, dp_rank: int, dp_size: int) -> SequenceBatches:
    s = job.spec
    return SequenceBatches(
        load_corpus(job, "train"),
        seq_len=s.data.seq_len,
        micro_batch_size=s.training.micro_batch_size,
        grad_accum=max(1, s.training.global_batch_size // (s.training.micro_batch_size * dp_size)),
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=s.training.seed,
        shuffle=s.data.shuffle,
    )
