"""Native gang admission reads the cluster as of when it holds the admission lock, not as of when its pass began:
queued behind hundreds of admissions, a pass waits long, and the gangs created meanwhile must count (the 1000-job
benchmark over-committed nodes when a snapshot taken before the wait was used)."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_placement import k8s_node

from jobs import make_job
from seqtrain_operator.k8s.passes import reconcile
from seqtrain_operator.k8s.settings import Settings

NODE = k8s_node("n1", gpus=0, cpu="2", memory="8Gi", pods=110)


def _job(name: str) -> dict[str, Any]:
    return make_job(name, "ml", metadata={"uid": f"uid-{name}", "resourceVersion": "1", "generation": 1},
                    replicas=1, resources={"gpus": 0, "cpu": "2", "memory": "1Gi"},
                    model={"arch": "gpt", "preset": "tiny"}, data={"source": "builtin", "seqLen": 64},
                    training={"steps": 10, "globalBatchSize": 4, "microBatchSize": 4})


def _running_pod(job: str) -> dict[str, Any]:
    """Job `job`'s pod as the index shows it once kube-scheduler bound it: it takes all of n1's CPU."""
    return {"metadata": {"name": f"{job}-1-0", "namespace": "ml", "labels": {"seqtrain.dev/job": job}},
            "spec": {"nodeName": "n1", "containers": [{"resources": {"requests": {"cpu": "2", "memory": "1Gi"}}}]},
            "status": {"phase": "Running"}}


@dataclass
class Kube:
    """Just what one admission pass calls; every call returns without yielding to the event loop."""

    body: dict[str, Any]
    created: list[dict] = field(default_factory=list)

    async def get_job(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.body)

    async def write_status(self, namespace: str, name: str, patch: dict, rv: str) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": str(int(rv) + 1)}}

    async def create(self, obj: dict[str, Any]) -> None:
        self.created.append(obj)

    async def list_pods(self, namespace: str | None, label_selector: str = "", field_selector: str = "") -> list:
        return []  # no other tenants


@dataclass
class Index:
    """reconcile.Views as kopf's indexes: what the watches have delivered so far."""

    pods_now: list[dict] = field(default_factory=list)

    def pods(self, namespace: str, job: str) -> list[dict]:
        return [p for p in self.pods_now if p["metadata"]["labels"]["seqtrain.dev/job"] == job]

    def all_pods(self) -> list[dict]:
        return list(self.pods_now)

    def nodes(self) -> list[dict]:
        return [NODE]


async def _admit_behind_another(job_a_appears: bool) -> list[dict]:
    """Job b's pass starts while another admission holds the lock; job a's pod shows up in the index (or not)
    before the lock is free. Returns the pods b created."""
    kube, index = Kube(_job("b")), Index()
    r = reconcile.Reconciler(kube, Settings(poll_progress=False))  # type: ignore[arg-type]
    await r.lock.acquire()
    try:
        task = asyncio.create_task(r.reconcile("ml", "b", lambda *a: None, index))
        for _ in range(5):  # b reads its job and the index, then waits for the lock
            await asyncio.sleep(0)
        assert not task.done()
        if job_a_appears:
            index.pods_now.append(_running_pod("a"))
    finally:
        r.lock.release()
    outcome = await task
    assert outcome.status is not None
    return [o for o in kube.created if o["kind"] == "Pod"]


def test_a_gang_created_while_an_admission_waited_for_the_lock_takes_its_capacity() -> None:
    assert asyncio.run(_admit_behind_another(job_a_appears=True)) == []  # n1 is full: b waits, nothing pinned


def test_with_nothing_created_meanwhile_the_waiting_admission_places_its_gang() -> None:
    pods = asyncio.run(_admit_behind_another(job_a_appears=False))
    assert [p["metadata"]["name"] for p in pods] == ["b-1-0"]  # the same pass does create when n1 is free


@pytest.mark.parametrize("unsure", [False, True])
def test_a_status_write_that_may_have_been_applied_keeps_the_gangs_reservation(unsure: bool) -> None:
    """A 409 on the status write releases the placed gang's capacity, unless an earlier attempt of that write timed
    out: then the status may name the placement already, the next pass creates the pods there, and the capacity
    must still be held for them (the 3000-job run pinned 8 gangs to nodes that had gone to other gangs)."""
    from seqtrain_operator.k8s.api.client import Conflict

    class Conflicting(Kube):
        async def write_status(self, namespace: str, name: str, patch: dict, rv: str) -> dict[str, Any]:
            raise Conflict("Conflict", unsure=unsure)

    kube = Conflicting(_job("b"))
    cfg = reconcile.Reconciler(kube, Settings(poll_progress=False))  # type: ignore[arg-type]
    outcome = asyncio.run(cfg.reconcile("ml", "b", lambda *a: None, Index()))
    assert outcome.requeue is not None and not kube.created
    assert sorted(cfg.busy.reserved) == ([("ml", "b-1-0")] if unsure else [])
    cfg.busy.release_job(("ml", "a"))  # another job's deletion leaves it
    assert len(cfg.busy.reserved) == (1 if unsure else 0)
    cfg.busy.release_job(("ml", "b"))  # its own ends it: none of its pods will be created now
    assert not cfg.busy.reserved
