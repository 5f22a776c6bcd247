"""Build the next step's micro-batches on a background thread while the current step runs.

The loop asks for step k; the answer was built during step k - 1 (on CUDA into pinned host memory, so the
copy to the device is asynchronous), and step k + 1 starts building at once. The data position in a
checkpoint must be that of the first step *not consumed*: each prefetched item carries the position from
before it was built, and `state_dict` returns that, so exact resume is unchanged by prefetching.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

from seqtrain.data.batches import Batch


class StepSource(Protocol):
    def next_step(self) -> list[Batch]: ...
    def state_dict(self) -> dict[str, Any]: ...


def pin(batch: Batch) -> Batch:
    """The batch in page-locked host memory (CUDA copies from it run asynchronously)."""
    return replace(batch, tokens=batch.tokens.pin_memory(), targets=batch.targets.pin_memory(),
                   doc_ids=None if batch.doc_ids is None else batch.doc_ids.pin_memory())


class Prefetcher:
    def __init__(self, data: StepSource, pin_memory: bool) -> None:
        self.data = data
        self.pin_memory = pin_memory
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seqtrain-prefetch")
        self._pending: Future | None = None

    def _build(self) -> tuple[dict[str, Any], list[Batch]]:
        state = self.data.state_dict()
        batches = self.data.next_step()
        return state, [pin(b) for b in batches] if self.pin_memory else batches

    def next_step(self) -> list[Batch]:
        future = self._pending if self._pending is not None else self._pool.submit(self._build)
        _, batches = future.result()  # re-raises a data error from the worker here, in the loop
        self._pending = self._pool.submit(self._build)
        return batches

    def state_dict(self) -> dict[str, Any]:
        """The position of the first step not yet handed out."""
        if self._pending is not None:
            return self._pending.result()[0]
        return self.data.state_dict()

    def reset(self) -> None:
        """Forget a prefetched step (before the source's position is changed, e.g. by a checkpoint load)."""
        if self._pending is not None:
            self._pending.result()  # let the worker finish touching the source first
            self._pending = None

    def close(self) -> None:
        self.reset()
        self._pool.shutdown(wait=True)
