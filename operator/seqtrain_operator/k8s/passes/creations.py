"""Gang creations beside the reconcile passes (kube-scheduler's binding cycle, for gangs).

A pass that admits a gang decides, writes the status that names the attempt and its placement, and hands the rest
(creating the gang's objects, then its Events) to a task here. Creating is most of a gang's requests (a Service, a
ConfigMap, one POST per pod) and, in a burst of admissions, most of their wait for the API client's budget: in the
1000-job run a pass that created its gang took up to 11.8 s (the reconcile p99), and while 64 such passes waited no
worker was free for a running job's pass. Here those requests go through the budget's bulk lane (client.Budget.bulk),
behind every pass's own requests, and a pass takes milliseconds.

Why it is safe: the status is written before the task starts, so an operator that dies meanwhile re-creates what is
absent of the attempt on its next pass, as it did when the creation ran inside the pass. While a job's creation
runs, its passes do nothing (`busy`): a pass that saw none of the gang's pods yet would otherwise plan it again. When
the task ends the job's next pass is scheduled when the creation asked (`on_done`).

`limit` creations run at once (each with its pods' POSTs in flight together); the others wait for a slot holding only
what they need to create (the job, its plan, its Events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("seqtrain.operator")

Key = tuple[str, str]  # (namespace, job)


class Creations:
    """`on_done(key, requeue)`: a creation ended; `requeue` is when the job's next pass should be (None: only an
    event; a creation that raised asks for one in a second). `on_seconds`: seconds from hand-off to end, per
    creation. `on_error(key, exc)`: a creation that raised (its reservations are released by the work itself)."""

    def __init__(self, limit: int = 16, on_done: Callable[[Key, float | None], None] = lambda key, requeue: None,
                 on_seconds: Callable[[float], None] = lambda s: None,
                 on_error: Callable[[Key, BaseException], None] = lambda key, exc: None):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self._on_done, self._on_seconds, self._on_error = on_done, on_seconds, on_error
        self._slots: asyncio.Semaphore | None = None  # made in the loop that first uses it
        self._tasks: dict[Key, asyncio.Task[None]] = {}

    def busy(self, key: Key) -> bool:
        return key in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, key: Key, work: Callable[[], Awaitable[float | None]]) -> None:
        """Run `work` (returns the job's next pass delay) in a task of its own; one per job at a time."""
        if key in self._tasks:
            raise RuntimeError(f"a creation for {key[0]}/{key[1]} is already running")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        self._tasks[key] = asyncio.get_running_loop().create_task(self._run(key, work, time.perf_counter()),
                                                                   name=f"seqtrain-create-{key[0]}/{key[1]}")

    async def _run(self, key: Key, work: Callable[[], Awaitable[float | None]], since: float) -> None:
        requeue: float | None = 1.0
        try:
            assert self._slots is not None
            async with self._slots:
                requeue = await work()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the job's next pass looks again; the error is counted
            self._on_error(key, exc)
        finally:
            self._tasks.pop(key, None)
            self._on_seconds(time.perf_counter() - since)
        self._on_done(key, requeue)

    async def wait(self, key: Key, timeout: float = 30.0) -> None:
        """Until the job's creation (if one runs) has ended; cancelled after `timeout` (its pods carry the job's
        ownerReference: what was created goes with the job)."""
        task = self._tasks.get(key)
        if task is None:
            return
        done, _ = await asyncio.wait([task], timeout=timeout)
        if not done:
            log.warning("%s/%s: its gang's creation still runs after %.0fs; cancelled", key[0], key[1], timeout)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
