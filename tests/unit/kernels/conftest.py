"""Kernel tests run the real Triton kernels: natively on a CUDA GPU, through Triton's interpreter on
the CPU.

`TRITON_INTERPRET=1` is read by `triton.jit` when `seqtrain.kernels.ops.<op>` is first imported, so it
must be in the environment before the first Triton call of the process. It is set per test with
monkeypatch (the ops are imported lazily, inside the first test that calls them), not globally:
other test packages in the same pytest process keep the automatic CPU choice (the PyTorch
reference) instead of silently running the slow interpreter.
"""

from __future__ import annotations

import pytest
import torch

from seqtrain.kernels import poison_outputs

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SEQTRAIN_KERNELS", raising=False)
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Every kernel output buffer starts as NaN: an element a kernel forgets to write fails the test.
    with poison_outputs():
        yield


@pytest.fixture
def device() -> str:
    return DEVICE
