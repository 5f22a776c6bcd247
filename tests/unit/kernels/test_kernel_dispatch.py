"""Backend choice: per call, SEQTRAIN_KERNELS override, no triton import on a plain CPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import seqtrain.kernels as K
from seqtrain.kernels import _alloc, reference

TRAINER = Path(__file__).resolve().parents[3] / "trainer"


@pytest.mark.slow
def test_import_and_cpu_calls_never_load_triton():
    code = (
        "import sys, torch, seqtrain.kernels as K\n"
        "x = torch.randn(2, 3, 4)\n"
        "K.rms_norm(x, torch.ones(4)); K.swiglu(x, x); K.linear_scan(x, x)\n"
        "K.attention(x[None], x[None], x[None], doc_ids=torch.zeros(1, 3, dtype=torch.long))\n"
        "assert K.backend_for(x) == 'torch'\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SEQTRAIN_KERNELS")}
    env["PYTHONPATH"] = str(TRAINER)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch rules")
def test_cpu_backend_follows_interpreter_flag_and_override(monkeypatch):
    x = torch.zeros(2)
    assert K.backend_for(x) == "triton"  # the fixture set TRITON_INTERPRET=1
    monkeypatch.setenv("SEQTRAIN_KERNELS", "torch")
    assert K.backend_for(x) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delenv("SEQTRAIN_KERNELS")
    assert K.backend_for(x) == "torch"
    monkeypatch.setenv("SEQTRAIN_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="SEQTRAIN_KERNELS=triton but the Triton path cannot run"):
        K.rms_norm(x, torch.ones(2))


def test_invalid_override_names_the_variable(monkeypatch):
    monkeypatch.setenv("SEQTRAIN_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SEQTRAIN_KERNELS='cuda' is not valid: use 'torch', 'triton' or 'auto'"):
        K.backend_for(torch.zeros(1))


def test_forced_torch_uses_the_reference_exactly(monkeypatch, device):
    monkeypatch.setenv("SEQTRAIN_KERNELS", "torch")
    x = torch.randn(3, 5, 8, device=device)
    w = torch.randn(8, device=device)
    assert torch.equal(K.rms_norm(x, w), reference.rms_norm(x, w))


def test_select_follows_the_kernels_option():
    assert K.select(False) is reference
    assert K.select(True) is K
    assert K.select(None) is K


def test_poison_fills_new_buffers_with_nan():
    with K.poison_outputs():
        assert torch.isnan(_alloc.empty(3, dtype=torch.float32, device="cpu")).all()
    with K.poison_outputs(False):
        assert not torch.isnan(_alloc.empty(3, dtype=torch.float32, device="cpu").zero_()).any()
