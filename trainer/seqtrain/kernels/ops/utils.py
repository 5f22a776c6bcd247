"""Helpers shared by the Triton ops: launch sizes, dtype mapping and the interpreter guard."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from seqtrain.kernels._runtime import interpret_requested

TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
            torch.float64: tl.float64}


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_launchable(kernel: object, t: torch.Tensor) -> None:
    """Fail clearly when a kernel decorated for one mode is launched on a tensor of the other.

    `triton.jit` picks interpreter or compiler when the op module is imported; a CPU tensor needs
    the interpreter, a CUDA tensor the compiler.
    """
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    if t.device.type == "cpu" and not interpreted:
        raise RuntimeError(
            "seqtrain.kernels: a Triton kernel was compiled for the GPU but got a CPU tensor. Set "
            "TRITON_INTERPRET=1 before seqtrain.kernels.ops is first imported (i.e. before the first "
            "Triton kernel call of the process) to run Triton on the CPU."
        )
    if t.is_cuda and interpreted and not interpret_requested():
        raise RuntimeError("seqtrain.kernels: Triton kernels were loaded in interpreter mode "
                           "(TRITON_INTERPRET=1 at import) but got a CUDA tensor; restart without it.")


def on_cpu(t: torch.Tensor) -> bool:
    """True when kernels on `t` run in the interpreter (which needs a few workarounds)."""
    return t.device.type == "cpu"


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def reduction_programs(t: torch.Tensor, rows: int) -> int:
    """Programs for a row loop with a per-program partial sum (e.g. a norm weight's gradient)."""
    if t.is_cuda:
        return max(1, min(rows, 4 * _sm_count(t.device.index or 0)))
    return max(1, min(rows, 4))  # the interpreter runs programs one by one: few, long programs


def row_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def store_dtype(dtype: torch.dtype, like: torch.Tensor) -> torch.dtype:
    """The dtype a kernel writes for an output of `dtype`.

    Triton 3.9's interpreter converts float32 to bfloat16 by truncation, not round-to-nearest-even
    as the GPU does, which doubles the rounding error. On the CPU, bfloat16 outputs are therefore
    written as float32 and rounded by torch afterwards (`.to(dtype)`); on CUDA they are written
    directly.
    """
    return torch.float32 if dtype == torch.bfloat16 and on_cpu(like) else dtype
