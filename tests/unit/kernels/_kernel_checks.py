"""Assertions shared by the kernel tests (module name is unique in the suite: no package here)."""

from __future__ import annotations

from typing import Any

import torch

from seqtrain.kernels import accuracy

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def assert_accurate(op: str, dtype: torch.dtype, device: str, seed: int = 0, **shape: Any) -> dict[str, Any]:
    """Kernel vs float64 oracle: fp32 within 1e-5 relative, bf16 within 2x the reference's error."""
    result = accuracy.measure(op, dtype, device, seed, **shape)
    assert result["backend"] == "triton", f"{op} ran the PyTorch reference, not the Triton kernel"
    problems = accuracy.violations(result)
    assert not problems, "\n".join(problems)
    return result
