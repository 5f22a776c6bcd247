"""Packing, bucketing and token-budget batching: no token lost, no target across documents, documents isolated
in every model (a token's output ignores other documents in its row), exact resume, disjoint rank shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from seqtrain.data import IGNORE_INDEX, Corpus
from seqtrain.data.packing import (
    DocumentBatches,
    build_batch,
    efficiency,
    pack_rows,
    plan_rows,
    split_documents,
)
from seqtrain.models import build_model
from seqtrain.spec.model import ModelSpec


def varied_corpus(n_docs: int = 400, seed: int = 0, vocab: int = 50) -> Corpus:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.5, 1.0, n_docs).astype(np.int64), 1, 400)  # 1 .. 400 tokens, median ~33
    tokens = rng.integers(0, vocab, lengths.sum()).astype(np.int32)
    return Corpus(tokens=tokens, doc_starts=np.concatenate(([0], np.cumsum(lengths)[:-1])))


def test_split_documents_covers_every_token_once() -> None:
    c = varied_corpus()
    p = split_documents(c.doc_starts, len(c), 64)
    assert (p.length <= 64).all() and (p.length >= 1).all()
    covered = np.zeros(len(c), dtype=int)
    for s, n in zip(p.start, p.length, strict=True):
        covered[s:s + n] += 1
    one_token_docs = np.diff(np.append(c.doc_starts, len(c))) == 1
    assert (covered[c.doc_starts[one_token_docs]] == 0).all()  # nothing to predict in a 1-token document
    assert covered.max() == 1 and covered.sum() == len(c) - one_token_docs.sum()


def test_pack_rows_fits_capacity_and_uses_each_piece_once() -> None:
    lengths = np.random.default_rng(1).integers(1, 65, 500)
    rows = pack_rows(lengths, 64)
    assert sorted(i for r in rows for i in r) == list(range(500))
    assert all(lengths[r].sum() <= 64 for r in rows)
    assert lengths.sum() / (64 * len(rows)) > 0.95


def test_packing_efficiency_beats_padding() -> None:
    c = varied_corpus()
    seq = 256
    packed = plan_rows(c, seq, packing=True)
    padded = plan_rows(c, seq, packing=False)
    real = packed.row_len.sum()
    assert real == padded.row_len.sum()
    eff_packed = real / (packed.num_rows * seq)
    eff_padded = real / (padded.num_rows * seq)
    assert eff_packed >= 0.95 and eff_padded < 0.5


def test_packed_batch_targets_stay_inside_documents() -> None:
    c = varied_corpus(60)
    plan = plan_rows(c, 128, packing=True)
    batch = build_batch(c, plan, np.arange(plan.num_rows), 128, packing=True)
    tok, tgt, doc = batch.tokens.numpy(), batch.targets.numpy(), batch.doc_ids.numpy()
    ends = np.append(c.doc_starts[1:], len(c))
    real_targets = int((ends - c.doc_starts - 1).clip(min=0).sum())
    assert (tgt != IGNORE_INDEX).sum() == real_targets  # every in-document next token, exactly once
    for r in range(tok.shape[0]):
        for j in range(127):
            if tgt[r, j] != IGNORE_INDEX and doc[r, j + 1] == doc[r, j]:
                assert tgt[r, j] == tok[r, j + 1]
        assert (tgt[r][doc[r] == -1] == IGNORE_INDEX).all()  # padding predicts nothing


@pytest.mark.parametrize("arch", ["gpt", "lstm", "gru", "qrnn"])
def test_token_output_ignores_other_documents_in_the_row(arch: str) -> None:
    torch.manual_seed(0)
    gpt = arch == "gpt"
    spec = ModelSpec(arch=arch, vocab_size=32, dim=16, layers=2, max_seq_len=24, heads=2 if gpt else None,
                     kv_heads=2 if gpt else None, ffn_dim=32 if gpt else None)
    model = build_model(spec).eval()
    tokens = torch.randint(0, 32, (2, 24))
    doc_ids = torch.tensor([[0] * 7 + [1] * 10 + [2] * 7, [0] * 24])
    alone = model(tokens[:1, 7:17])  # document 1 on its own, positions from 0
    with torch.no_grad():
        out = model(tokens, doc_ids)
        torch.testing.assert_close(out[0, 7:17], alone[0].detach(), rtol=1e-5, atol=1e-5)
        changed = tokens.clone()
        changed[0, :7] = torch.randint(0, 32, (7,))  # the document before
        changed[0, 17:] = torch.randint(0, 32, (7,))  # and the one after
        out2 = model(changed, doc_ids)
    torch.testing.assert_close(out2[0, 7:17], out[0, 7:17], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out2[0, :7], out[0, :7])  # the changed document itself does change
    torch.testing.assert_close(out2[1], out[1], rtol=1e-6, atol=1e-6)


def make(c: Corpus, rank: int = 0, dp: int = 1, **kw) -> DocumentBatches:
    args = {"seq_len": 64, "micro_batch_size": 4, "grad_accum": 2, "seed": 3} | kw
    return DocumentBatches(c, dp_rank=rank, dp_size=dp, **args)


@pytest.mark.parametrize("kw", [{"packing": True}, {"bucketing": True}, {"max_tokens_per_batch": 300},
                                {"packing": True, "max_tokens_per_batch": 200}])
def test_exact_resume_and_disjoint_rank_shards(kw: dict) -> None:
    c = varied_corpus(150)
    a = make(c, **kw)
    for _ in range(5):
        a.next_step()
    b = make(c, **kw)
    b.load_state_dict(a.state_dict())
    for _ in range(30):  # crosses an epoch boundary
        for x, y in zip(a.next_step(), b.next_step(), strict=True):
            assert torch.equal(x.tokens, y.tokens) and torch.equal(x.targets, y.targets)
    one = make(c, dp=1, grad_accum=4, **kw)
    r0, r1 = make(c, 0, 2, **kw), make(c, 1, 2, **kw)
    for _ in range(3):
        whole = one.next_step()
        s0, s1 = r0.next_step(), r1.next_step()
        # rank r takes micro-batches r, r+2, ...: together exactly the single-rank step, nothing shared
        interleaved = [s0[0], s1[0], s0[1], s1[1]]
        assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(whole, interleaved, strict=True))


def test_bucketing_reduces_padding_and_budget_is_respected() -> None:
    c = varied_corpus(600)
    plain = make(c, max_tokens_per_batch=512)
    bucketed = make(c, max_tokens_per_batch=512, bucketing=True)
    steps = 20
    e_plain = efficiency([b for _ in range(steps) for b in plain.next_step()])
    bs = [b for _ in range(steps) for b in bucketed.next_step()]
    assert efficiency(bs) > e_plain + 0.1
    assert all(b.slots <= 512 for b in bs)
    assert len({b.tokens.shape[0] for b in bs}) > 1  # variable rows per micro-batch


def test_budget_below_one_sequence_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="maxTokensPerBatch"):
        make(varied_corpus(20), max_tokens_per_batch=10)
