"""Built-in corpus split, byte tokenizer, and the resumable rank-sharded batch iterator."""

from __future__ import annotations

import os

import numpy as np
import pytest

from seqtrain.data import ByteTokenizer, Corpus, SequenceBatches, eval_batches, load_builtin, window_batch
from seqtrain.data.builtin import in_validation, stdlib_files, stdlib_root


def small_corpus(n: int = 1000) -> Corpus:
    return Corpus(tokens=(np.arange(n) % 251).astype(np.uint8), doc_starts=np.array([0], dtype=np.int64))


def rows(batches) -> list[tuple[int, ...]]:  # noqa: ANN001
    return [tuple(r) for b in batches for r in b.tokens.tolist()]


def test_builtin_split_is_deterministic_disjoint_and_complete() -> None:
    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    val = [f for f in files if in_validation(f, 0.05)]
    assert 0 < len(val) < len(files) * 0.2
    assert val == [f for f in files if in_validation(f, 0.05)]  # same answer every time
    train, valid = load_builtin("train", 0.05), load_builtin("validation", 0.05)
    assert len(valid) > 0 and len(train) > 5 * len(valid)
    assert train.tokens.dtype == np.uint8 and train.doc_starts[0] == 0
    nonempty = [f for f in files if os.path.getsize(os.path.join(stdlib_root(), f)) > 0]
    assert len(train.doc_starts) + len(valid.doc_starts) == len(nonempty)
    assert b"def " in train.tokens[:200_000].tobytes()
    with pytest.raises(ValueError, match="split"):
        load_builtin("test", 0.05)


def test_byte_tokenizer_round_trips_unicode() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids.max() < tok.vocab_size == 256 and len(ids) == len("héllo ✓".encode())
    assert tok.decode(ids) == "héllo ✓"


def test_targets_are_tokens_shifted_by_one() -> None:
    c = small_corpus()
    b = window_batch(c.tokens, np.array([0, 100]), 16)
    assert b.tokens.shape == b.targets.shape == (2, 16)
    assert b.tokens[0, 1:].tolist() == b.targets[0, :-1].tolist()
    assert b.targets[1, -1].item() == c.tokens[116]
    assert int(b.num_targets()) == 32 and b.slots == 32


def test_data_parallel_shards_are_the_single_rank_batch_split() -> None:
    """dp=2 x accum=1 and dp=1 x accum=2 see the same sequences per step (loss parity across layouts)."""
    c = small_corpus()
    single = SequenceBatches(c, seq_len=8, micro_batch_size=3, grad_accum=2, seed=7)
    ranks = [SequenceBatches(c, seq_len=8, micro_batch_size=3, grad_accum=1, dp_rank=r, dp_size=2, seed=7)
             for r in range(2)]
    for _ in range(5):
        want = rows(single.next_step())
        r0, r1 = rows(ranks[0].next_step()), rows(ranks[1].next_step())
        assert r0 + r1 == want
        assert not set(r0) & set(r1)


def test_every_epoch_is_a_permutation_and_epochs_differ() -> None:
    c = small_corpus(8 * 10 + 1)  # exactly 10 sequences of 8
    it = SequenceBatches(c, seq_len=8, micro_batch_size=2, grad_accum=1, seed=3)
    epoch1 = [r for _ in range(5) for r in rows(it.next_step())]
    epoch2 = [r for _ in range(5) for r in rows(it.next_step())]
    assert sorted(epoch1) == sorted(epoch2) and len(set(epoch1)) == 10
    assert epoch1 != epoch2
    assert it.epoch == 2.0
    # a batch straddling the epoch boundary (global batch 4 does not divide 10)
    it3 = SequenceBatches(c, seq_len=8, micro_batch_size=4, grad_accum=1, seed=3)
    seen = [r for _ in range(5) for r in rows(it3.next_step())]
    assert sorted(seen[:10]) == sorted(epoch1)


def test_state_dict_resumes_the_exact_sequence_order() -> None:
    c = small_corpus()
    a = SequenceBatches(c, seq_len=8, micro_batch_size=2, grad_accum=2, dp_rank=1, dp_size=2, seed=1)
    for _ in range(7):
        a.next_step()
    state = a.state_dict()
    expected = [rows(a.next_step()) for _ in range(3)]
    b = SequenceBatches(c, seq_len=8, micro_batch_size=2, grad_accum=2, dp_rank=1, dp_size=2, seed=1)
    b.load_state_dict(state)
    assert [rows(b.next_step()) for _ in range(3)] == expected
    other = SequenceBatches(small_corpus(500), seq_len=8, micro_batch_size=2, grad_accum=2)
    with pytest.raises(ValueError, match="data changed"):
        other.load_state_dict(state)


def test_no_shuffle_reads_in_order_and_eval_batches_repeat() -> None:
    c = small_corpus()
    it = SequenceBatches(c, seq_len=8, micro_batch_size=2, grad_accum=1, shuffle=False)
    assert [r[0] for r in rows(it.next_step())] == [0, 8]
    first = [b.tokens.tolist() for b in eval_batches(c, 8, 2, num_batches=3, dp_rank=1, dp_size=2)]
    again = [b.tokens.tolist() for b in eval_batches(c, 8, 2, num_batches=3, dp_rank=1, dp_size=2)]
    assert first == again and first[0][0][0] == 16  # rank 1 starts after rank 0's first micro-batch
    with pytest.raises(ValueError, match="shorter than one sequence"):
        SequenceBatches(small_corpus(5), seq_len=8, micro_batch_size=1, grad_accum=1)
