"""What native gang admission counts as taking node capacity: every non-terminated pod bound or pinned to a node,
cluster-wide, as kube-scheduler counts them, plus the gangs this operator has decided to create but the API has not
shown yet (kube-scheduler's "assumed" pods).

The running operator counts pods with the capacity ledger (k8s/capacity/ledger.py) and keeps only its reservations here
(`outstanding`); the LIST below serves a pass without the indexes. Where the pods come from, cheapest first:
- the operator's own pods: its label-selected pod mirror (k8s/cache/mirror.py), always current and free to read;
- everyone else's: one LIST of the pods without the job label, shared by every admission within `ttl` seconds
  (a cluster's other tenants); it does not grow with the number of SeqTrainJobs, so 1000 queued jobs neither LIST
  8000 pods 1000 times nor once every few seconds;
- without an index (a one-off pass): one LIST of every pod, shared the same way.

A reservation is taken while the admission lock is held, before the status write and the pod creations, so the
lock covers only the decision: the next job is planned around the reserved pods while this one's are still being
created. It ends when the pod shows up where the admission reads our pods (the index, or a LIST), when the caller
releases it (the write or the creation failed), or when the pod is known to be gone without having been seen:
- with the index, its DELETED watch event (`gone`; kopf delivers the pod's events in order, so a pod created and
  deleted between two admissions still ends its reservation), else after BACKSTOP_SECONDS (an event missed while
  the watch was re-established);
- without it, a LIST started after the creation returned that lacks the pod (a LIST is a consistent read).
Never by a short clock: the 1000-job benchmark on two cores showed kopf's index lagging the API by over a minute,
and a reservation that lapsed before the index showed its pods let the next jobs be planned onto the same nodes
(pods pinned to full nodes stay Pending for good).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.planner.inventory import Requests, node_of, pod_requests

BACKSTOP_SECONDS = 900.0
_NOT_TERMINATED = "status.phase!=Succeeded,status.phase!=Failed"

Key = tuple[str, str]  # (namespace, name)


def _key(pod: Mapping[str, Any]) -> Key:
    meta = pod.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


def _live(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


@dataclass
class BusyPods:
    ttl: float = 5.0
    listed: list[dict] = field(default_factory=list)  # the last LIST (foreign pods only, or all: see `listed_all`)
    listed_at: float = float("-inf")  # time.monotonic() when that LIST was sent
    listed_all: bool = False
    reserved: dict[Key, tuple[float, dict]] = field(default_factory=dict)  # key -> (monotonic time, pod)
    lists: int = 0  # LISTs made (a figure for the benchmark and the tests)
    _use: dict[Key, tuple[str, Requests] | None] = field(default_factory=dict)  # see `outstanding_use`

    def reserve(self, pods: Iterable[dict]) -> list[Key]:
        keys = []
        for pod in pods:
            self._use.pop(_key(pod), None)
            self.reserved[_key(pod)] = (float("inf"), pod)  # no clock until created (see `created`)
            keys.append(_key(pod))
        return keys

    def created(self, keys: Iterable[Key]) -> None:
        """The creations returned: the reservations' clocks start now (until then they never lapse)."""
        now = time.monotonic()
        for k in keys:
            if k in self.reserved:
                self.reserved[k] = (now, self.reserved[k][1])

    def release(self, keys: Iterable[Key]) -> None:
        for k in keys:
            self.reserved.pop(k, None)

    def release_job(self, job: Key) -> None:
        """The job is deleted: none of its reserved pods will be created now (one kept after a status write that
        may or may not have been applied, reconcile.Pass.write_status, would otherwise hold its capacity)."""
        ns, name = job
        self.reserved = {k: v for k, v in self.reserved.items()
                         if not (k[0] == ns and (v[1]["metadata"].get("labels") or {}).get(m.LABEL_JOB) == name)}

    def gone(self, key: Key) -> None:
        """The pod's DELETED watch event: whether or not an admission saw it, it takes nothing now."""
        self.reserved.pop(key, None)

    def outstanding_use_of(self, job: Key) -> list[tuple[str, Requests]]:
        """What the reservations of `job`'s own pods take (a gang admitted again while its last one's pods have not
        shown: counted free for that job alone, as `outstanding` leaves them out for it)."""
        ns, name = job
        return [use for k, (_, pod) in self.reserved.items()
                if k[0] == ns and (pod["metadata"].get("labels") or {}).get(m.LABEL_JOB) == name
                and (use := self._use_of(k, pod)) is not None]

    def _use_of(self, key: Key, pod: dict) -> tuple[str, Requests] | None:
        use = self._use.get(key)
        if use is None and key not in self._use:
            node = node_of(pod)
            use = self._use[key] = (node, pod_requests(pod)) if node is not None else None
        return use

    def outstanding_use(self, seen: Callable[[Key], bool], exclude_job: Key | None) -> list[tuple[str, Requests]]:
        """`outstanding` as (node, requests): computed once per reserved pod (a reservation has no resourceVersion
        for the inventory's memo; the 300-job profile spent 9 % of the operator's CPU re-parsing them)."""
        out = []
        for pod in self.outstanding(seen, exclude_job):
            if (use := self._use_of(_key(pod), pod)) is not None:
                out.append(use)
        if len(self._use) > 2 * len(self.reserved) + 1000:  # forget the ended reservations now and then
            self._use = {k: v for k, v in self._use.items() if k in self.reserved}
        return out

    def outstanding(self, seen: Callable[[Key], bool], exclude_job: Key | None) -> list[dict]:
        """The reserved pods a capacity ledger (k8s/capacity/ledger.py) has not shown yet, less those of `exclude_job`.
        A reservation the ledger shows ends (its pod counts there now), so does one older than BACKSTOP_SECONDS."""
        now = time.monotonic()
        self.reserved = {k: v for k, v in self.reserved.items() if not seen(k) and now - v[0] < BACKSTOP_SECONDS}
        if exclude_job is None:
            return [pod for _, pod in self.reserved.values()]
        ns, name = exclude_job
        return [pod for _, pod in self.reserved.values()
                if not (pod["metadata"].get("namespace") == ns
                        and (pod["metadata"].get("labels") or {}).get(m.LABEL_JOB) == name)]

    async def current(self, kube: Any, exclude_job: Key, ours: list[dict] | None = None) -> list[dict]:
        """Busy pods, less those of `exclude_job` (namespace, name): a job being admitted has no live pods, so any
        still shown are gone or going (a restart must not be blocked by its own previous gang). `ours`: every pod
        of this operator's jobs (the index); None: read them from the API as well."""
        want_all = ours is None
        if time.monotonic() - self.listed_at > self.ttl or self.listed_all != want_all:
            selector = "" if want_all else f"!{m.LABEL_JOB}"
            sent = time.monotonic()
            self.listed = await kube.list_pods(None, label_selector=selector, field_selector=_NOT_TERMINATED)
            self.listed_at, self.listed_all = sent, want_all
            self.lists += 1
        pods = self.listed if ours is None else [*self.listed, *(p for p in ours if _live(p))]
        seen = {_key(p) for p in (self.listed if ours is None else (*self.listed, *ours))}
        now = time.monotonic()

        def holds(created_at: float) -> bool:  # for a reservation not seen: is its pod possibly still coming?
            if ours is None:  # the LIST is of every pod: one sent after the creation returned would show it
                return created_at >= self.listed_at
            return now - created_at < BACKSTOP_SECONDS

        self.reserved = {k: v for k, v in self.reserved.items() if k not in seen and holds(v[0])}
        ns, name = exclude_job
        return [p for p in (*pods, *(pod for _, pod in self.reserved.values()))
                if not (p["metadata"].get("namespace") == ns
                        and (p["metadata"].get("labels") or {}).get(m.LABEL_JOB) == name)]
