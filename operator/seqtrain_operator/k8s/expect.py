"""The pods this operator knows it created, per job and attempt, until its cache shows them (a controller's
"expectations", as in kube-controller-manager's ReplicaSet controller).

Why: the core re-creates whatever of the live attempt it does not observe (a creation cut short must be finished),
and it observes through kopf's pod index, which lags the API: by over a minute in the 1000-job benchmark, by a
fraction of a second after a restart of the operator on a loaded machine. Without this record a pass that ran
before the index caught up re-POSTed the gang it had just created (answered 409: wasted requests, and the
restart test counts them).

An entry ends when the pod's DELETED watch event arrives (kopf delivers a pod's events in order, so a pod created
and deleted before the index showed it still ends its entry), when the job starts another attempt or is deleted,
or after BACKSTOP_SECONDS (an event missed while the watch was re-established). A job this memory knows nothing
about (a freshly started operator) is asked of the API instead: one label-selected LIST of the attempt's pods (a
consistent read) before anything is re-created.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

BACKSTOP_SECONDS = 300.0

Key = tuple[str, str]  # (namespace, job)


@dataclass
class _Attempt:
    attempt: int
    names: set[str]
    at: float


@dataclass
class Expectations:
    jobs: dict[Key, _Attempt] = field(default_factory=dict)
    # (namespace, pod) -> job: where a DELETED event's pod is expected (its labels are not needed to find it)
    owners: dict[Key, str] = field(default_factory=dict)

    def created(self, job: Key, attempt: int, pods: Iterable[str]) -> None:
        """These pods of `attempt` exist now (the API answered their creation 201 or 409, or a LIST showed them)."""
        entry = self.jobs.get(job)
        if entry is None or entry.attempt != attempt:
            self.forget(job)
            entry = self.jobs[job] = _Attempt(attempt, set(), time.monotonic())
        entry.at = time.monotonic()
        for name in pods:
            entry.names.add(name)
            self.owners[(job[0], name)] = job[1]

    def known(self, job: Key, attempt: int) -> set[str] | None:
        """The pods of `attempt` known to exist (None: this memory cannot say; ask the API)."""
        entry = self.jobs.get(job)
        if entry is None or entry.attempt != attempt or time.monotonic() - entry.at > BACKSTOP_SECONDS:
            return None
        return set(entry.names)

    def gone(self, namespace: str, pod: str) -> None:
        """The pod's DELETED watch event: it no longer exists, whatever the index showed of it."""
        job = self.owners.pop((namespace, pod), None)
        if job is not None and (entry := self.jobs.get((namespace, job))) is not None:
            entry.names.discard(pod)

    def forget(self, job: Key) -> None:
        entry = self.jobs.pop(job, None)
        if entry is not None:
            for name in entry.names:
                self.owners.pop((job[0], name), None)
