"""One admission cycle for every gang waiting for capacity (pure): the order they are tried in, the capacity each
one's plan takes from the next ones', and head-of-line reservation.

Why: admission was one lock per gang, taken in the order the daemons happened to reach it; each holder re-read the
free capacity of every node, and the 300-job benchmark's reconcile passes waited up to 51 s for it (p99). Now the
shell (k8s/capacity/admission.py) collects the gangs that wait, reads the capacity once, and plans them in one pass
here.

Order: higher priority first (the PriorityClass value of `scheduling.priorityClassName`), then earlier arrival
(the job's creation), then name: what Kueue's BestEffortFIFO and kube-scheduler's queue do. A gang that does not
fit lets the ones behind it through (backfill) until it has waited HEAD_OF_LINE_SECONDS; from then on it is the
head of the line and no gang of its priority or lower is admitted before it, so small gangs arriving all the time
cannot starve a large one. Higher priorities still pass it (preemption is kube-scheduler's, not ours).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from seqtrain_operator.planner.inventory import Requests
from seqtrain_operator.planner.types import Node

HEAD_OF_LINE_SECONDS = 120.0

T = TypeVar("T")


@dataclass(frozen=True)
class Waiting(Generic[T]):
    key: tuple[str, str]  # (namespace, job)
    priority: int
    arrival: str  # the job's creationTimestamp (ISO-8601 in UTC sorts as time)
    waited: float  # seconds it has waited for capacity so far (0: first cycle)
    # Plan the gang on these nodes (None: it may not be admitted now, for the reason given): what it decided, and
    # the capacity its planned pods take, as (node, requests) pairs (empty: it did not fit).
    plan: Callable[[tuple[Node, ...] | None, str | None], tuple[T, list[tuple[str, Requests]]]]
    own: tuple[tuple[str, Requests], ...] = ()  # what its own going pods still take (counted free for it only)


def order(waiting: Iterable[Waiting[T]]) -> list[Waiting[T]]:
    return sorted(waiting, key=lambda w: (-w.priority, w.arrival, w.key))


def admit(nodes: Sequence[Node], waiting: Iterable[Waiting[T]]) -> list[tuple[Waiting[T], T, bool]]:
    """Plan every waiting gang in order on what the ones before it left; returns (gang, its decision, placed)."""
    free = {n.name: n for n in nodes}
    out: list[tuple[Waiting[T], T, bool]] = []
    head: Waiting[T] | None = None  # the gang at the head of the line, once it has waited long enough
    for w in order(waiting):
        blocked = None
        if head is not None and w.priority <= head.priority:
            blocked = (f"waiting behind {head.key[0]}/{head.key[1]}, which has waited {head.waited:.0f}s for room "
                       f"and goes first (head of the line after {HEAD_OF_LINE_SECONDS:.0f}s, so that large gangs "
                       f"do not starve)")
        mine = tuple(take(free.values(), w.own, sign=-1)) if w.own and blocked is None else None
        decision, uses = w.plan(None if blocked else (mine or tuple(free.values())), blocked)
        placed = bool(uses)
        if placed:
            for n in take([free[name] for name, _ in uses if name in free], uses):
                free[n.name] = n
        elif blocked is None and head is None and w.waited >= HEAD_OF_LINE_SECONDS:
            head = w
        out.append((w, decision, placed))
    return out


def take(nodes: Iterable[Node], uses: Iterable[tuple[str, Requests]], sign: int = 1) -> list[Node]:
    """The nodes with `uses` taken from their free capacity (sign -1: given back). Nodes not named are left out."""
    by_name = {n.name: n for n in nodes}
    total: dict[str, Requests] = {}
    for name, r in uses:
        if name in by_name:
            total[name] = total.get(name, Requests()) + r
    out = []
    for name, n in by_name.items():
        r = total.get(name)
        if r is None:
            out.append(n)
            continue
        other = dict(n.other)
        for k, v in r.other:
            other[k] = max(0, other.get(k, 0) - sign * v)
        out.append(replace(n, gpus=max(0, n.gpus - sign * r.gpus), cpu_millis=max(0, n.cpu_millis - sign * r.cpu_millis),
                           memory_bytes=max(0, n.memory_bytes - sign * r.memory_bytes),
                           pods=None if n.pods is None else max(0, n.pods - sign * r.pods), other=other))
    return out
