"""Model-side step costs and vocabulary padding: the fused RMSNorm keeps the reference's numbers, a padded
vocabulary trains like the unpadded one and never shows its pad rows."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from seqtrain.data import IGNORE_INDEX
from seqtrain.models import build_model
from seqtrain.models.layers import rms_norm
from seqtrain.models.loss import CausalLMLoss
from seqtrain.spec.model import ModelSpec, layout_problems


def test_rms_norm_through_f_rms_norm_is_the_formula_bit_for_bit():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 64).to(dtype).requires_grad_()
        w = torch.randn(64).requires_grad_()
        xf = x.float()
        formula = ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)) * w).to(dtype)
        got = rms_norm(x, w, 1e-5)
        assert got.dtype == dtype and torch.equal(got, formula)
        g = torch.randn_like(got)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, (x, w), g),
                                                      torch.autograd.grad(formula, (x, w), g), strict=True))


def _spec(pad: int, tie: bool = True) -> ModelSpec:
    return ModelSpec(arch="gpt", vocab_size=65, dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=64, max_seq_len=16,
                     tie_embeddings=tie, pad_vocab_to=pad)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_padded_model_has_the_unpadded_weights_loss_and_gradients(tie):
    torch.manual_seed(3)
    plain = build_model(_spec(1, tie))
    torch.manual_seed(3)
    padded = build_model(_spec(64, tie))
    assert padded.embed.weight.shape[0] == 128 and padded.vocab_size == 65
    for (name, a), (_, b) in zip(plain.named_parameters(), padded.named_parameters(), strict=True):
        assert torch.equal(a, b[:a.shape[0]]), name  # the real rows: drawn exactly as without padding
        assert not b[a.shape[0]:].any(), name  # the pad rows: zero
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, 65, (3, 16), generator=g), torch.randint(0, 65, (3, 16), generator=g)
    targets[0, :4] = IGNORE_INDEX
    losses = []
    for model in (plain, padded):
        loss = CausalLMLoss(model)(tokens, targets)
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for (name, a), (_, b) in zip(plain.named_parameters(), padded.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad[:a.shape[0]], rtol=1e-5, atol=1e-6), name
        assert not b.grad[a.shape[0]:].any(), name  # no gradient ever reaches a pad row


def test_unpadded_by_default_and_refused_where_unsupported():
    assert _spec(1).padded_vocab_size == 65 and _spec(8).padded_vocab_size == 72
    assert build_model(_spec(1)).embed.weight.shape[0] == 65
    problems = dict(layout_problems(_spec(64), tensor_parallel=2, pipeline_parallel=1, sequence_parallel=False))
    assert "tensorParallel" in problems["spec.model.padVocabTo"]
    lstm = ModelSpec(arch="lstm", vocab_size=65, dim=32, layers=1, pad_vocab_to=64)
    assert "only applies to arch gpt" in dict(layout_problems(lstm, 1, 1, False))["spec.model.padVocabTo"]


def test_export_and_generate_see_the_real_vocabulary(tmp_path):
    """A padded run's checkpoint exports (and generates) with vocabSize rows; model.init pads them back."""
    safetensors = pytest.importorskip("safetensors.torch")
    from seqtrain.export.init import load_initial_weights
    from seqtrain.export.writer import export
    from seqtrain.generate import load_generator
    from seqtrain.runtime.dist import DistContext
    from seqtrain.spec import RuntimeConfig, load_job, resolve
    from seqtrain.train.loop import Trainer

    job = resolve(load_job(JOB))
    run = tmp_path / "run"
    trainer = Trainer(job, RuntimeConfig(workdir=str(run), checkpoint_dir=str(run / "checkpoints")), DistContext())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.setup()
        assert trainer.model.embed.weight.shape[0] == 320  # 257 rounded up to a multiple of 64
        trainer.run()
    summary = export(str(run), str(tmp_path / "out"))
    tensors = safetensors.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape[0] == 257
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vocab_size"] == 257 and summary["format"] == "hf"
    model, _ = load_generator(str(run))
    assert model.output_weight.shape[0] == 257
    fresh = build_model(job.spec.model)  # a padded model starting from the export
    load_initial_weights(fresh, str(tmp_path / "out"))
    assert torch.equal(fresh.embed.weight[:257], model.embed.weight) and not fresh.embed.weight[257:].any()


JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: padded}
spec:
  model: {arch: gpt, vocabSize: 257, padVocabTo: 64, dim: 32, layers: 1, heads: 2, ffnDim: 64, maxSeqLen: 32}
  data: {source: builtin, seqLen: 32}
  training: {steps: 2, globalBatchSize: 2, microBatchSize: 2, schedule: {warmupSteps: 1}}
  checkpoint: {intervalSteps: 2, keep: 1}
"""
