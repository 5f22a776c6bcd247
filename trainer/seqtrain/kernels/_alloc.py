"""Output allocation for the Triton kernels, with a test hook that poisons new buffers.

Every buffer a kernel is expected to fill completely is allocated through `empty()`. Inside
`poison_outputs()` those buffers are pre-filled with NaN, so a test that compares results against a
reference fails when a kernel leaves any element unwritten (a masked store off by one, a missing
program in the grid, a skipped tile). Outside tests the fill costs nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_state = threading.local()


def poisoning() -> bool:
    return getattr(_state, "poison", False)


@contextlib.contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    """Within this block, kernel output buffers start as NaN instead of uninitialised memory."""
    previous = poisoning()
    _state.poison = enabled
    try:
        yield
    finally:
        _state.poison = previous


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.empty`, or a NaN-filled tensor while `poison_outputs()` is active (floats only)."""
    out = torch.empty(*shape, dtype=dtype, device=device)
    if poisoning() and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(*t.shape, dtype=dtype or t.dtype, device=t.device)
