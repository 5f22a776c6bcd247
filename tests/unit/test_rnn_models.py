"""Sequence models: lstm, gru and qrnn (and gpt) build from presets, share the model contract, and learn a
synthetic copy task well above chance through packed batches."""

from __future__ import annotations

import pytest
import torch

from seqtrain.data.packing import DocumentBatches
from seqtrain.data.synthetic import load_synthetic
from seqtrain.models import build_model, count_parameters
from seqtrain.models.loss import linear_cross_entropy
from seqtrain.models.qrnn import linear_scan, reference_linear_scan
from seqtrain.spec import load_job, resolve
from seqtrain.spec.data import SyntheticSpec
from seqtrain.spec.model import ModelSpec

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {{name: rnn}}
spec:
  model: {{arch: {arch}, preset: tiny}}
  data: {{seqLen: 32}}
"""


@pytest.mark.parametrize("arch", ["lstm", "gru", "qrnn"])
def test_preset_builds_with_the_model_contract(arch: str) -> None:
    spec = resolve(load_job(JOB.format(arch=arch))).spec.model
    model = build_model(spec)
    assert len(model.layers) == spec.layers == 2
    hidden = model(torch.randint(0, 256, (3, 32)))
    assert hidden.shape == (3, 32, 64)
    assert model.output_weight is model.embed.weight  # tied by default
    per_layer = {"lstm": 8 * 64 * 64 + 8 * 64, "gru": 6 * 64 * 64 + 6 * 64, "qrnn": 6 * 64 * 64 + 3 * 64}[arch]
    assert count_parameters(model) == 256 * 64 + 2 * per_layer + 64  # embedding + layers + final norm


def test_fo_pooling_is_a_linear_scan() -> None:
    torch.manual_seed(0)
    a, b, h0 = torch.rand(2, 37, 5), torch.randn(2, 37, 5), torch.randn(2, 5)
    h, expect = h0, []
    for t in range(37):
        h = a[:, t] * h + b[:, t]
        expect.append(h)
    torch.testing.assert_close(reference_linear_scan(a, b, h0), torch.stack(expect, 1))
    torch.testing.assert_close(linear_scan(a, b, h0), torch.stack(expect, 1))


@pytest.mark.parametrize("arch", ["gpt", "lstm", "gru", "qrnn"])
def test_model_learns_copy_task_above_chance(arch: str) -> None:
    torch.manual_seed(0)
    task = SyntheticSpec(task="copy", length=4, vocab=8)  # chance: 1/8 per copied symbol
    gpt = arch == "gpt"
    spec = ModelSpec(arch=arch, vocab_size=12, dim=32, layers=2, max_seq_len=32, heads=2 if gpt else None,
                     kv_heads=2 if gpt else None, ffn_dim=64 if gpt else None)
    model = build_model(spec)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = DocumentBatches(load_synthetic(task, "train", 0, num_examples=3000), 32, 16, 1, packing=True)
    for _ in range(80 if gpt else 150):  # recurrent models are cheaper per step but need more of them
        b = data.next_step()[0]
        loss = linear_cross_entropy(model(b.tokens, b.doc_ids), model.output_weight, b.targets) / b.num_targets()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    val = DocumentBatches(load_synthetic(task, "validation", 0, num_examples=200), 32, 32, 1, packing=True)
    b = val.next_step()[0]
    with torch.no_grad():
        pred = (model(b.tokens, b.doc_ids) @ model.output_weight.t()).argmax(-1)
    scored = b.targets != -100
    acc = (pred[scored] == b.targets[scored]).float().mean().item()
    assert acc > 0.5, f"{arch}: accuracy {acc:.2f} on held-out copies (chance 0.125)"
