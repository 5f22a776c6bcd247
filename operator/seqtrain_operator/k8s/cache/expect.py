"""The pods this operator knows it created for one job's attempt, until its cache shows them (a controller's
"expectations", as in kube-controller-manager's ReplicaSet controller). One `Expected` per job, in its JobMemory
(k8s/cache/memory.py).

Why: the core re-creates whatever of the live attempt it does not observe (a creation cut short must be finished),
and it observes through the pod mirror, which lags the API (by over a minute under a burst of creations, by a
fraction of a second after a restart of the operator on a loaded machine). Without this record a pass that ran
before the mirror caught up re-POSTed the gang it had just created (answered 409: wasted requests).

The record of a pod ends when its DELETED watch event arrives (events of one pod arrive in order, so a pod created
and deleted before the mirror showed it still ends its entry); the whole record ends when the job starts another
attempt, is deleted, or after BACKSTOP_SECONDS (an event missed while the watch was re-established). A job this
memory knows nothing about (a freshly started operator) is asked of the API instead: one label-selected LIST of the
attempt's pods (a consistent read) before anything is re-created.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

BACKSTOP_SECONDS = 300.0


@dataclass
class Expected:
    attempt: int = 0  # 0: nothing known
    names: set[str] = field(default_factory=set)
    at: float = float("-inf")  # time.monotonic() of the last creation recorded

    def created(self, attempt: int, pods: Iterable[str]) -> None:
        """These pods of `attempt` exist now (the API answered their creation 201 or 409, or a LIST showed them)."""
        if attempt != self.attempt:
            self.attempt, self.names = attempt, set()
        self.at = time.monotonic()
        self.names.update(pods)

    def known(self, attempt: int) -> set[str] | None:
        """The pods of `attempt` known to exist (None: this memory cannot say; ask the API)."""
        if self.attempt == 0 or attempt != self.attempt or time.monotonic() - self.at > BACKSTOP_SECONDS:
            return None
        return set(self.names)

    def gone(self, pod: str) -> None:
        """The pod's DELETED watch event: it no longer exists, whatever the mirror showed of it."""
        self.names.discard(pod)
