"""Where a reconcile pass reads its job from (k8s/readjob.read_job): the watch's body, our own last write, or a
GET. Found by the operator benchmark: 4.6 GETs per job in the 300-job run, one after nearly every status write."""

from __future__ import annotations

import asyncio
import copy
from datetime import datetime, timedelta, timezone
from typing import Any

from seqtrain_operator.k8s.api.finalizers import FINALIZER
from seqtrain_operator.k8s.cache.memory import STALE, JobMemory
from seqtrain_operator.k8s.passes.readjob import KOPF_SETTLE_SECONDS, kopf_settling, read_job


class Kube:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body, self.gets = body, 0

    async def get_job(self, namespace: str, name: str) -> dict[str, Any]:
        self.gets += 1
        return copy.deepcopy(self.body)


def job(rv: str, phase: str, generation: int = 1, finalizers: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"metadata": {"name": "j", "namespace": "ml", "resourceVersion": rv, "generation": generation,
                         "finalizers": list(finalizers)}, "status": {"phase": phase}}


def read(kube: Kube, mem: JobMemory, live: dict[str, Any]) -> dict[str, Any] | None:
    return asyncio.run(read_job(kube, mem, live))  # type: ignore[arg-type]


def test_the_watch_body_our_own_write_or_a_get() -> None:
    mem = JobMemory("ml", "j", "u1")
    kube = Kube(job("5", "Pending"))
    assert read(kube, mem, job("4", "Pending")) == job("4", "Pending") and kube.gets == 0  # first sight
    assert read(kube, mem, job("4b", "Pending")) == job("4b", "Pending") and kube.gets == 0  # still: nothing known
    mem.known = STALE  # our write based on it conflicted: read it
    assert read(kube, mem, job("4", "Pending"))["metadata"]["resourceVersion"] == "5"  # type: ignore[index]
    assert kube.gets == 1 and mem.known == "5"
    assert read(kube, mem, job("5", "Pending")) == job("5", "Pending") and kube.gets == 1  # the watch caught up
    # our status write at 5 returned 6; the watch still shows 5: what the write returned is the newest
    mem.known, mem.written = "6", ("5", job("6", "Scheduling"))
    assert read(kube, mem, job("5", "Pending")) == job("6", "Scheduling") and kube.gets == 1
    # kopf patched its annotations after our write (7): the watch's body carries our status, so it is newer
    assert read(kube, mem, job("7", "Scheduling", finalizers=("f",))) == job("7", "Scheduling", finalizers=("f",))
    assert kube.gets == 1 and mem.known == "7" and mem.written is None
    # someone else changed the job (a spec edit: a new generation): read it
    kube.body = job("9", "Scheduling", generation=2)
    mem.known, mem.written = "8", ("7", job("8", "Running"))
    assert read(kube, mem, job("9", "Scheduling", generation=2)) == job("9", "Scheduling", generation=2)
    assert kube.gets == 2


def test_a_new_jobs_first_write_waits_for_kopfs_finalizer_then_reads_the_job_if_it_is_late() -> None:
    t0 = datetime(2026, 11, 26, 10, 0, tzinfo=timezone.utc)
    new = {"metadata": {"creationTimestamp": "2026-11-26T10:00:00Z", "finalizers": [], "annotations": {}}}
    assert kopf_settling(new, t0 + timedelta(seconds=1)) is True  # wait: kopf's finalizer PATCH is coming
    assert kopf_settling(new, t0 + timedelta(seconds=KOPF_SETTLE_SECONDS + 1)) is False  # late: GET the job
    new["metadata"]["finalizers"] = [FINALIZER]
    assert kopf_settling(new, t0 + timedelta(seconds=2)) is None  # done: kopf writes nothing else (NoDiffBase)
    assert kopf_settling({"metadata": {}, "status": {"phase": "Running"}}, t0) is None  # not a new job
