"""GPT and LSTM language models: shapes, causality, packed documents, parameter counts, gradients."""

from __future__ import annotations

import pytest
import torch

from seqtrain.models import GPT, LSTMLM, build_model, count_parameters
from seqtrain.models.layers import document_positions, rms_norm, rope, rope_tables
from seqtrain.spec import load_job, resolve
from seqtrain.spec.model import ModelSpec

GPT_SPEC = ModelSpec(arch="gpt", vocab_size=256, dim=32, layers=2, heads=4, kv_heads=4, ffn_dim=64, max_seq_len=64)
LSTM_SPEC = ModelSpec(arch="lstm", vocab_size=256, dim=32, layers=2, max_seq_len=64)


def tokens(b: int = 2, t: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spec", [GPT_SPEC, LSTM_SPEC], ids=["gpt", "lstm"])
def test_forward_returns_hidden_and_output_weight_is_the_tied_embedding(spec: ModelSpec) -> None:
    torch.manual_seed(0)
    model = build_model(spec)
    x = tokens()
    hidden = model(x)
    assert hidden.shape == (2, 24, 32) and hidden.dtype == torch.float32
    assert model.output_weight.shape == (256, 32)
    assert model.output_weight is model.embed.weight
    untied = build_model(spec.model_copy(update={"tie_embeddings": False}))
    assert untied.output_weight is not untied.embed.weight
    assert count_parameters(untied) == count_parameters(model) + 256 * 32


@pytest.mark.parametrize("spec", [GPT_SPEC, LSTM_SPEC], ids=["gpt", "lstm"])
def test_hidden_state_never_depends_on_future_tokens(spec: ModelSpec) -> None:
    torch.manual_seed(0)
    model = build_model(spec).eval()
    x = tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    hx, hy = model(x), model(y)
    torch.testing.assert_close(hx[:, :10], hy[:, :10], rtol=0, atol=0)
    assert not torch.allclose(hx[:, 10:], hy[:, 10:])


def test_gpt_packed_documents_equal_separate_documents() -> None:
    """With doc_ids, a document packed after another sees neither it nor shifted RoPE positions."""
    torch.manual_seed(0)
    model = GPT(GPT_SPEC).eval()
    a, b = tokens(1, 10, seed=1), tokens(1, 14, seed=2)
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14])
    h = model(packed, doc_ids)
    torch.testing.assert_close(h[:, :10], model(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h[:, 10:], model(b), rtol=1e-5, atol=1e-5)
    # without doc_ids the second document does attend to the first
    assert not torch.allclose(model(packed)[:, 10:], model(b), atol=1e-4)


def test_document_positions_restart_at_each_document() -> None:
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert document_positions(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_gpt_structure_for_per_block_parallelism_and_gqa() -> None:
    spec = GPT_SPEC.model_copy(update={"kv_heads": 2})
    model = GPT(spec)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert model.blocks[0].attn.k.weight.shape == (2 * 8, 32)  # 2 kv heads of dim 8
    assert model(tokens()).shape == (2, 24, 32)
    with pytest.raises(ValueError, match="maxSeqLen"):
        model(tokens(1, 65))


def test_lstm_layers_are_a_module_list() -> None:
    model = LSTMLM(LSTM_SPEC)
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 2


def test_parameter_counts_match_the_architecture() -> None:
    d, f, v, n = 32, 64, 256, 2
    per_block = 4 * d * d + 3 * d * f + 2 * d  # q k v out, gate up down, two norm scales
    assert count_parameters(GPT(GPT_SPEC)) == v * d + n * per_block + d
    per_layer = 4 * (d * d + d * d + 2 * d)  # 4 gates: input + recurrent weights, two biases
    assert count_parameters(LSTMLM(LSTM_SPEC)) == v * d + n * per_layer + d


def test_every_parameter_gets_a_gradient() -> None:
    torch.manual_seed(0)
    for spec in (GPT_SPEC, LSTM_SPEC):
        model = build_model(spec)
        x = tokens()
        loss = torch.nn.functional.cross_entropy((model(x) @ model.output_weight.t()).flatten(0, 1), x.flatten())
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing, missing


def test_presets_resolve_into_buildable_models() -> None:
    job = resolve(load_job("apiVersion: seqtrain.dev/v1alpha1\nkind: SeqTrainJob\nmetadata: {name: m}\n"
                           "spec: {model: {arch: gpt, preset: mini}, data: {seqLen: 128}}"))
    model = build_model(job.spec.model)
    assert len(model.blocks) == 4 and model.output_weight.shape == (256, 128)
    with pytest.raises(ValueError, match="resolve"):
        build_model(ModelSpec(arch="gpt"))


def test_building_blocks_match_their_formulas() -> None:
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    w = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w)
    cos, sin = rope_tables(16, 8, 10000.0)
    q = torch.randn(1, 2, 16, 8)
    rq = rope(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths
    torch.testing.assert_close(rq[:, :, 0], q[:, :, 0])  # position 0 is not rotated


def _qkv(kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 48, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 48, 8, generator=g) for _ in range(2))
    doc_ids = torch.tensor([[0] * 5 + [1] * 30 + [2] * 13, [7] * 48])  # odd lengths, one unpacked row
    return q, k, v, doc_ids


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_flex_document_attention_equals_the_dense_mask(causal: bool, kv_heads: int) -> None:
    """The CUDA path (flex_attention + block mask) against the dense [B, 1, T, T] mask the CPU keeps; here
    eager flex forward (PyTorch's CPU flex_attention has no backward)."""
    from seqtrain.models.layers import attention, flex_document_attention

    q, k, v, doc_ids = _qkv(kv_heads)
    dense = attention(q, k, v, causal=causal, doc_ids=doc_ids)
    with torch.no_grad():
        flex = flex_document_attention(q, k, v, doc_ids, causal, compiled=False)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_gqa_via_enable_gqa_equals_repeated_kv_heads_forward_and_backward(packed: bool) -> None:
    from seqtrain.models.layers import attention

    q, k, v, doc_ids = _qkv(2)
    ids = doc_ids if packed else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, doc_ids=ids)
    out.square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = [ref[0], ref[1].repeat_interleave(2, dim=1), ref[2].repeat_interleave(2, dim=1)]
    want = attention(*rep, doc_ids=ids)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(leaves, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_bf16_cast_rope_tables_give_the_native_engines_rotation() -> None:
    """DeepSpeed bf16 casts the whole module, RoPE tables included; the native engines keep fp32 tables and
    `rope` casts them to the activations' dtype at use. Same rounding, so the rotation is bit-identical."""
    torch.manual_seed(0)
    model = build_model(GPT_SPEC.model_copy(update={"max_seq_len": 4096}))
    cast = build_model(GPT_SPEC.model_copy(update={"max_seq_len": 4096})).to(torch.bfloat16)
    assert cast.rope_cos.dtype == torch.bfloat16 and model.rope_cos.dtype == torch.float32
    q = torch.randn(1, 4, 4096, 8).to(torch.bfloat16)  # long context: the angles where bf16 rounding bites
    native = rope(q, model.rope_cos, model.rope_sin)
    deepspeed = rope(q, cast.rope_cos, cast.rope_sin)
    assert torch.equal(native, deepspeed)
