"""Backend choice for `seqtrain.kernels`, made per call.

Nothing here imports triton at module import time: a CPU machine that never asks for the Triton
path never loads it. Triton is imported (once, cached) only when a call could use it: the tensor is
on CUDA, or `TRITON_INTERPRET=1` asks for Triton's CPU interpreter.

`TRITON_INTERPRET` is read by `triton.jit` when a kernel is *decorated*, i.e. when
`seqtrain.kernels.ops.<op>` is first imported. Set it before the first Triton call of the process.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]

ENV_BACKEND = "SEQTRAIN_KERNELS"
_TRUE = {"1", "true", "yes", "on"}


def interpret_requested() -> bool:
    """True when the user asked for Triton's CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


@functools.lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """None when triton imports, else why it does not (cached: importing is slow)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as exc:  # noqa: BLE001 - any failure means "use the reference"
        return f"{type(exc).__name__}: {exc}"
    return None


def forced_backend() -> Backend | None:
    """The backend forced by `SEQTRAIN_KERNELS`, or None for automatic choice."""
    value = os.environ.get(ENV_BACKEND, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("torch", "triton"):
        return value  # type: ignore[return-value]
    raise ValueError(f"{ENV_BACKEND}={value!r} is not valid: use 'torch', 'triton' or 'auto' (or unset it)")


def _triton_can_run(t: torch.Tensor) -> str | None:
    """None when a Triton kernel can run on `t`, else the reason it cannot."""
    if t.is_cuda:
        pass
    elif t.device.type == "cpu":
        if not interpret_requested():
            return "tensor is on the CPU and TRITON_INTERPRET=1 is not set"
    else:
        return f"Triton kernels do not run on device {t.device.type!r}"
    err = triton_import_error()
    return None if err is None else f"triton cannot be imported ({err})"


def backend_for(t: torch.Tensor) -> Backend:
    """Which implementation a `seqtrain.kernels` call on `t` will use: "triton" or "torch".

    Automatic rule: Triton when the tensor is on CUDA, or on the CPU with `TRITON_INTERPRET=1`,
    and triton imports; the PyTorch reference otherwise. `SEQTRAIN_KERNELS=torch|triton` forces one;
    forcing Triton where it cannot run is an error rather than a silent fallback.
    """
    forced = forced_backend()
    if forced == "torch":
        return "torch"
    reason = _triton_can_run(t)
    if forced == "triton" and reason is not None:
        raise RuntimeError(
            f"{ENV_BACKEND}=triton but the Triton path cannot run: {reason}. "
            "Use a CUDA tensor, set TRITON_INTERPRET=1 before the first kernel call, "
            f"or unset {ENV_BACKEND}."
        )
    return "triton" if reason is None else "torch"
