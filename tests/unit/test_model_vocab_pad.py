"""Model-side step costs and vocabulary padding: the fused RMSNorm keeps the reference's numbers, a padded
vocabulary trains like the unpadded one and never shows its pad rows."""

from __future__ import annotations

import torch

from seqtrain.models.layers import rms_norm


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
