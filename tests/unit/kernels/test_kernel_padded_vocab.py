"""The fused loss of a model with model.padVocabTo sees only the real vocabulary rows (the kernel has no pad
mask: it gets the real rows, a contiguous view of the padded weight)."""

from __future__ import annotations

import torch

from seqtrain.models import build_model
from seqtrain.models.dispatch import apply_kernels
from seqtrain.models.loss import CausalLMLoss
from seqtrain.spec.model import ModelSpec


def test_fused_loss_of_a_padded_model_equals_the_unpadded_reference(device):
    spec = ModelSpec(arch="gpt", vocab_size=37, dim=16, layers=1, heads=2, kv_heads=2, ffn_dim=32, max_seq_len=8,
                     pad_vocab_to=16)
    torch.manual_seed(0)
    padded = build_model(spec).to(device)
    torch.manual_seed(0)
    plain = build_model(spec.model_copy(update={"pad_vocab_to": 1})).to(device)
    apply_kernels(padded, True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 37, (2, 8), generator=g).to(device)
    targets = torch.randint(0, 37, (2, 8), generator=g).to(device)
    fused, ref = CausalLMLoss(padded)(tokens, targets), CausalLMLoss(plain)(tokens, targets)
    fused.backward()
    ref.backward()
    assert torch.allclose(fused, ref, rtol=1e-4, atol=1e-4)
    assert torch.allclose(padded.embed.weight.grad[:37], plain.embed.weight.grad, rtol=1e-3, atol=1e-4)
    assert not padded.embed.weight.grad[37:].any()
