"""A keyed work queue with a bounded number of workers (client-go's workqueue, for asyncio).

Each job's passes used to run in a loop of its own (one kopf daemon per job, each with its timers and waiters). With
1000 jobs that is 1000 loops and up to 1000 passes in flight at once, each holding its job, its observation and its
plan while it waits for an admission cycle or the API client's rate budget: the 1000-job benchmark's memory peak.
Here a pass runs only in one of `workers` tasks, so at most that many are in flight, whatever the number of jobs.

The rules are client-go's:
- a key is queued at most once: adding a queued key again does nothing (events coalesce);
- a key is processed by one worker at a time: added while its pass runs, it is marked dirty and queued again when
  the pass ends (the pass may have read the cluster before the change);
- what a pass returns is when its key is due again (None: only an event brings it back), replacing any earlier
  timer for it; a pass that raises is retried after a backoff that doubles per consecutive failure of that key;
- only active keys are processed: `activate` when the operator may act on the job (kopf runs its daemon: not
  paused by peering, not being deleted), `deactivate` when that ends, which waits for a pass in flight (and cancels
  it after `timeout`), so a deleted job's clean-up never races its own pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Hashable

log = logging.getLogger("seqtrain.operator")

BACKOFF_BASE = 0.5  # seconds: half the first retry's delay (1 s, then 2 s, 4 s, ... up to BACKOFF_CAP)
BACKOFF_CAP = 30.0


def backoff(failures: int) -> float:
    """Seconds before retrying a key whose last `failures` passes raised."""
    return min(BACKOFF_CAP, BACKOFF_BASE * 2 ** min(max(failures, 1), 6))


class WorkQueue:
    """`process(key)` runs one pass and returns the seconds until the key's next one (None: none scheduled).
    `on_error(key, exc, retry_in)` is told each pass that raised."""

    def __init__(self, process: Callable[[Hashable], Awaitable[float | None]], workers: int = 64,
                 on_error: Callable[[Hashable, BaseException, float], None] = lambda key, exc, delay: None,
                 on_depth: Callable[[int], None] = lambda depth: None):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._process = process
        self._workers = workers
        self._on_error = on_error
        self._on_depth = on_depth
        self._fifo: asyncio.Queue[Hashable] = asyncio.Queue()
        self._queued: set[Hashable] = set()
        self._dirty: set[Hashable] = set()
        self._running: dict[Hashable, asyncio.Task[float | None]] = {}
        self._active: set[Hashable] = set()
        self._failures: dict[Hashable, int] = {}
        self._due: dict[Hashable, float] = {}  # key -> time.monotonic() of its next pass
        self._timers: list[tuple[float, int, Hashable]] = []  # a heap; entries no longer in _due are stale
        self._seq = itertools.count()
        self._timer_wake = asyncio.Event()
        self._idle = asyncio.Event()  # set whenever a pass ends (deactivate waits for its key's)
        self._tasks: list[asyncio.Task[None]] = []
        self.passes = 0

    # -- what the handlers call

    def start(self) -> None:
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._worker(), name=f"seqtrain-worker-{i}") for i in range(self._workers)]
        self._tasks.append(loop.create_task(self._timer(), name="seqtrain-workqueue-timer"))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._running.values()]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def activate(self, key: Hashable) -> None:
        self._active.add(key)
        self.add(key)

    async def deactivate(self, key: Hashable, timeout: float = 8.0) -> None:
        """No more passes for `key`; returns once none is in flight (one still running after `timeout` is
        cancelled)."""
        self._active.discard(key)
        self._due.pop(key, None)
        self._dirty.discard(key)
        self._failures.pop(key, None)
        deadline = time.monotonic() + timeout
        while (task := self._running.get(key)) is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                task.cancel()
                await asyncio.wait([task])
                return
            self._idle.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=left)

    def add(self, key: Hashable) -> None:
        """A pass for `key` as soon as a worker is free (once, however often it is added meanwhile)."""
        if key not in self._active:
            return
        if key in self._running:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._fifo.put_nowait(key)
            self._on_depth(len(self._queued))

    def add_after(self, key: Hashable, seconds: float) -> None:
        """A pass for `key` within `seconds` (client-go's AddAfter): one already due sooner, or queued, stands; a key
        whose pass runs is marked dirty instead (that pass may have read the cluster before the change). Events
        that come in bursts (a gang's pods bound and started one by one) then make one pass, not one each."""
        if key not in self._active:
            return
        if key in self._running:
            self._dirty.add(key)
            return
        if key in self._queued:
            return
        due = self._due.get(key)
        if due is not None and due <= time.monotonic() + seconds:
            return
        self.schedule(key, seconds)

    def add_all(self) -> None:
        for key in list(self._active):
            self.add(key)

    def schedule(self, key: Hashable, seconds: float | None) -> None:
        """The key's next pass in `seconds` (None: none), replacing the timer it had."""
        if seconds is None or key not in self._active:
            self._due.pop(key, None)
            return
        due = time.monotonic() + max(0.0, seconds)
        self._due[key] = due
        seq = next(self._seq)
        heapq.heappush(self._timers, (due, seq, key))
        if self._timers[0][1] == seq:  # now the earliest: the timer task sleeps until a later one
            self._timer_wake.set()

    def __len__(self) -> int:
        return len(self._queued)

    @property
    def active(self) -> frozenset[Hashable]:
        return frozenset(self._active)

    def running(self, key: Hashable) -> bool:
        return key in self._running

    # -- the tasks

    async def _worker(self) -> None:
        while True:
            key = await self._fifo.get()
            self._queued.discard(key)
            self._on_depth(len(self._queued))
            if key not in self._active:
                continue
            self._due.pop(key, None)  # this pass decides when the next one is
            task = asyncio.ensure_future(self._process(key))
            self._running[key] = task
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:  # the queue stops
                task.cancel()
                raise
            finally:
                del self._running[key]
                self._idle.set()
            self.passes += 1
            if task.cancelled():
                continue
            if (exc := task.exception()) is not None:
                failures = self._failures[key] = self._failures.get(key, 0) + 1
                delay: float | None = backoff(failures)
                self._on_error(key, exc, delay)  # type: ignore[arg-type]
            else:
                self._failures.pop(key, None)
                delay = task.result()
            if key in self._dirty:
                self._dirty.discard(key)
                self.add(key)
            else:
                self.schedule(key, delay)

    async def _timer(self) -> None:
        while True:
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                due, _, key = heapq.heappop(self._timers)
                if self._due.get(key) == due:
                    del self._due[key]
                    self.add(key)
            self._timer_wake.clear()
            timeout = self._timers[0][0] - now if self._timers else None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._timer_wake.wait(), timeout=timeout)
