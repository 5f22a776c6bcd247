"""Peak memory of a function call, on CUDA and on the CPU.

CUDA: the caching allocator's peak (`torch.cuda.max_memory_allocated`) above the level before the
call. The CPU allocator keeps no statistics, so on the CPU `LiveTensorBytes` tracks every tensor
storage that a torch operator creates during the call (factory ops, results, autograd buffers) and
frees (a weakref finalizer on the storage), and reports the peak of their sum. Views and in-place
results share an argument's storage and are not counted again. Memory that Triton's interpreter
allocates in numpy is not a torch tensor and is not counted: it is an artefact of emulating the GPU,
not part of the kernel's design.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Dispatch mode that records the peak bytes of tensor storages created inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._tracked:
            return
        self._tracked.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:  # views and in-place results are not new memory
                    self._track(storage)
        return out


class NewTensors(TorchDispatchMode):
    """Dispatch mode that records (shape, dtype) of every tensor an operator returns in new memory (views and
    in-place results of an argument excluded): a test's proof that a path never materialises some tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        self.seen += [(tuple(t.shape), t.dtype) for t in tree_flatten(out)[0]
                      if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        return out


def peak_bytes(fn: Callable[[], Any], device: torch.device | str) -> int:
    """Peak memory (bytes) allocated while `fn()` runs, above what was allocated before it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del result
        return peak
    with LiveTensorBytes() as mode:
        result = fn()
    del result
    return mode.peak
