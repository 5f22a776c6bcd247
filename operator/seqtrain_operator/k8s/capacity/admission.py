"""Native gang admission as one cycle for every waiting gang (the shell of planner/queue.py).

A reconcile pass whose gang waits for capacity hands its plan to `Admissions.admit` and awaits the decision. One
task runs the cycles: it takes every gang handed in since the last cycle, reads the free capacity once (the ledger
and the reservations: k8s/capacity/ledger.py, k8s/capacity/busy.py), plans them in priority and arrival order
(planner/queue.py), and reserves each placed gang's pods before the next one is planned, all without awaiting anything,
so no other pass can see capacity in between. The status writes and the pod creations then run in each job's own pass,
as before.

The time a pass spends waiting for its cycle is admission queueing, not reconcile work: it is measured as
`seqtrain_admission_wait_seconds` and left out of `seqtrain_reconcile_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from seqtrain_operator.planner.inventory import Requests, node_of, pod_requests
from seqtrain_operator.planner.queue import Waiting, admit
from seqtrain_operator.planner.types import Node

log = logging.getLogger("seqtrain.operator")
Key = tuple[str, str]
PRIORITY_TTL_SECONDS = 60.0  # a PriorityClass's value is read again after this long
JOIN_SECONDS = 2.0  # how long a cycle waits for the passes of gangs ahead of its own (see `Admissions._gather`)


@dataclass
class Admissions:
    """`free()`: every node's free capacity now. `reserve(pods)`: count a placed gang's pods until the ledger shows
    them (BusyPods.reserve). `own(key)`: what the job's own going pods still take. `on_wait(seconds)`: how long a
    gang waited for its decision; `on_cycle(seconds)`: how long one cycle took."""

    free: Callable[[], list[Node]]
    reserve: Callable[[list[dict]], list[tuple[str, str]]]
    own: Callable[[Key], list[tuple[str, Requests]]] = lambda key: []
    on_wait: Callable[[float], None] = lambda seconds: None
    on_cycle: Callable[[float], None] = lambda seconds: None
    # Wake a job's pass (Runtime.poke): a cycle asks the gangs ahead of its own to join it.
    poke: Callable[[Key], None] = lambda key: None
    pending: list[tuple[Waiting[Any], asyncio.Future[None]]] = field(default_factory=list)
    first_seen: dict[Key, float] = field(default_factory=dict)  # time.monotonic() it first waited (head of line)
    # Every gang still waiting for capacity, as (priority, arrival): one whose pass is not in a cycle is asked to
    # join it before a gang behind it is planned (see `_gather`).
    waiting: dict[Key, tuple[int, str]] = field(default_factory=dict)
    cycles: int = 0
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    async def admit(self, key: Key, priority: int, arrival: str,
                    plan: Callable[[tuple[Node, ...] | None, str | None], tuple[Any, list[dict]]]
                    ) -> tuple[Any, list[tuple[str, str]]]:
        """Wait for the next cycle; returns (the decision `plan` made in it, the keys of the pods reserved for it).
        `plan(nodes, None)` decides with that capacity; `plan(None, why)` decides that it may not be admitted now."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="seqtrain-admission")
        now = time.monotonic()
        waited = now - self.first_seen.setdefault(key, now)
        reserved: list[tuple[str, str]] = []
        made: list[Any] = []

        def planned(nodes: tuple[Node, ...] | None, blocked: str | None) -> tuple[Any, list[tuple[str, Requests]]]:
            try:
                decision, pods = plan(nodes, blocked)
            except Exception as exc:  # noqa: BLE001 - this job's pass raises it; the cycle goes on for the others
                made.append(exc)
                return None, []
            made.append(decision)
            reserved.extend(self.reserve(pods))  # now: the next gang of this cycle is planned around them
            return decision, [(node, pod_requests(p)) for p in pods if (node := node_of(p)) is not None]

        future: asyncio.Future[None] = loop.create_future()
        self.waiting[key] = (priority, arrival)
        self.pending.append((Waiting(key, priority, arrival, waited, planned, tuple(self.own(key))), future))
        self._wake.set()
        await future
        self.on_wait(time.monotonic() - now)
        if isinstance(made[-1], Exception):
            raise made[-1]
        return made[-1], reserved

    def done(self, key: Key) -> None:
        """The job no longer waits (admitted, deleted, suspended): its head-of-line clock ends."""
        self.first_seen.pop(key, None)
        self.waiting.pop(key, None)

    async def _gather(self, batch: list[tuple[Waiting[Any], asyncio.Future[None]]]
                      ) -> list[tuple[Waiting[Any], asyncio.Future[None]]]:
        """The batch, joined by the waiting gangs that go before one of its gangs (higher priority, or the same and
        earlier) but whose passes have not handed in yet: they are woken and awaited up to JOIN_SECONDS. Without
        this the order held only among passes that happened to arrive together: a node added for two waiting gangs
        went to whichever pass was quicker, not to the higher priority (found by the priority test)."""
        deadline = time.monotonic() + JOIN_SECONDS
        while True:
            there = {w.key for w, _ in batch}
            last = max(((-w.priority, w.arrival) for w, _ in batch), default=None)
            missing = [k for k, (p, a) in self.waiting.items() if k not in there and last is not None
                       and (-p, a) < last]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                return batch
            for k in missing:
                self.poke(k)
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=left)
            batch, self.pending = batch + self.pending, []

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self.pending = self.pending, []
            if not batch:
                continue
            batch = await self._gather(batch)
            started = time.monotonic()
            futures = {id(w): fut for w, fut in batch}
            try:
                results = admit(self.free(), [w for w, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every waiting pass gets the error; the cycles go on
                log.warning("admission cycle failed (%s: %s)", type(exc).__name__, exc)
                for fut in futures.values():
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.cycles += 1
            for w, _, placed in results:
                if placed:
                    self.done(w.key)
                if not (fut := futures[id(w)]).done():
                    fut.set_result(None)
            self.on_cycle(time.monotonic() - started)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
