"""What this operator remembers of each job, in one record per job incarnation (`JobMemory`), created when the job is
first seen and dropped by one `Jobs.forget(uid)`.

Keyed by uid: a job deleted and re-created under the same name at once is another job, and its predecessor's record
(its versions, its expectations, its adapters' bookkeeping) must never be read or dropped for it. The (namespace,
name) key, which the work queue and the watches use, points at the newest incarnation seen.

Everything here can be lost (a restarted operator starts empty): it only saves requests, never decides alone. The
job's status and the cluster are the truth; see each field for what a fresh record costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from seqtrain_operator.k8s.cache.expect import Expected

Key = tuple[str, str]  # (namespace, name)
STALE = ""  # JobMemory.known: our last status write conflicted; the next pass GETs the job


@dataclass(eq=False)
class JobMemory:
    namespace: str
    name: str
    uid: str
    live: Any = None  # kopf's live body of the job (replaced in place on every watch event); None: no daemon runs
    # The job's resourceVersion this operator last read or wrote (STALE: our last write conflicted): a pass whose
    # live body has it reads no GET (reconcile.read_job). None: nothing known yet.
    known: str | None = None
    # (the version our last status write replaced, what the write returned), until the watch shows that write
    written: tuple[str, dict[str, Any]] | None = None
    written_at: float = float("-inf")  # time.monotonic() of our last status write (progress is coalesced)
    expected: Expected = field(default_factory=Expected)  # pods created and not in the mirror yet (k8s/cache/expect.py)
    restarts: tuple[int, int] | None = None  # (restarts, infraRestarts) last counted into the metrics
    poked: bool = False  # an event arrived while its gang was being created: a pass when the creation ends
    boost: int | None = None  # Kueue: the priority boost last written to its Workload (gangs/kueue.py)
    touched: tuple[str, float] | None = None  # coscheduling: (PodGroup, time.monotonic()) of its last retry touch

    @property
    def key(self) -> Key:
        return self.namespace, self.name


@dataclass(eq=False)
class Jobs:
    """Every JobMemory, by uid, and which one each (namespace, name) names now."""

    by_uid: dict[str, JobMemory] = field(default_factory=dict)
    by_key: dict[Key, str] = field(default_factory=dict)

    def seen(self, namespace: str, name: str, uid: str) -> JobMemory:
        """The record of this incarnation, created on first sight; the name points at it from now on."""
        mem = self.by_uid.get(uid)
        if mem is None:
            mem = self.by_uid[uid] = JobMemory(namespace, name, uid)
        self.by_key[(namespace, name)] = uid
        return mem

    def get(self, namespace: str, name: str) -> JobMemory | None:
        """The newest incarnation of this name that was seen (None: none)."""
        uid = self.by_key.get((namespace, name))
        return self.by_uid.get(uid) if uid is not None else None

    def of_uid(self, uid: str | None) -> JobMemory | None:
        return self.by_uid.get(uid) if uid else None

    def forget(self, uid: str) -> JobMemory | None:
        """Drop the record of this incarnation (its job was deleted); the name's pointer goes only if it is this
        incarnation's (a re-created namesake keeps its own). Returns the record dropped."""
        mem = self.by_uid.pop(uid, None)
        if mem is not None and self.by_key.get(mem.key) == uid:
            del self.by_key[mem.key]
        return mem

    def __len__(self) -> int:
        return len(self.by_uid)
