"""Gang creations beside the passes (k8s/passes/creations.py) and the API client's bulk lane (client.Budget.bulk): a
pass that admits a gang writes the status and returns; the gang's objects are created in a task of their own, behind
every pass's own requests, and the job's passes keep off it until it ends."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from test_admission_lock import Index, Kube, _job

from seqtrain_operator.k8s.api import client as kc
from seqtrain_operator.k8s.passes import reconcile
from seqtrain_operator.k8s.passes.creations import Creations
from seqtrain_operator.k8s.settings import Settings

# ---- the bulk lane ------------------------------------------------------------------------------------------------

def test_bulk_work_leaves_the_passes_a_reserve_and_keeps_to_qps() -> None:
    async def run() -> tuple[float, float]:
        b = kc.Budget(qps=100.0, burst=8)  # a reserve of 2 tokens
        started = time.monotonic()
        takers = [asyncio.create_task(b.bulk()) for _ in range(30)]
        await asyncio.sleep(0.05)  # bulk work drains the bucket down to the reserve, never below it
        pass_wait = b.delay()  # a pass's request: from the reserve, at once
        await asyncio.gather(*takers)
        return pass_wait, time.monotonic() - started

    pass_wait, elapsed = asyncio.run(run())
    assert pass_wait == 0.0
    # 30 bulk tokens and one for the pass from a bucket of 8 refilled at 100/s: at least 0.23 s, never faster
    assert elapsed >= 0.23


def test_a_pass_request_taken_during_bulk_work_is_not_queued_behind_it() -> None:
    async def run() -> list[float]:
        b = kc.Budget(qps=50.0, burst=4)  # a reserve of 1
        takers = [asyncio.create_task(b.bulk()) for _ in range(20)]
        await asyncio.sleep(0.1)
        waits = [b.delay()]  # the reserve
        await asyncio.sleep(0.03)  # one token refilled: bulk may not take it below the reserve
        waits.append(b.delay())
        for t in takers:
            t.cancel()
        await asyncio.gather(*takers, return_exceptions=True)
        return waits

    first, second = asyncio.run(run())
    assert first == 0.0
    assert second < 0.05  # at most one token's wait, not twenty's (0.4 s)


# ---- Creations ----------------------------------------------------------------------------------------------------

def test_creations_run_one_per_job_at_most_limit_at_once_and_report_their_end() -> None:
    async def run() -> tuple[list[Any], int, list[Any]]:
        done: list[Any] = []
        errors: list[Any] = []
        gate = asyncio.Event()
        running = peak = 0

        async def work(requeue: float | None) -> float | None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await gate.wait()
            running -= 1
            if requeue == -1:
                raise RuntimeError("apiserver gone")
            return requeue

        c = Creations(limit=2, on_done=lambda k, r: done.append((k, r)), on_error=lambda k, e: errors.append(k))
        c.start(("ml", "a"), lambda: work(10.0))
        c.start(("ml", "b"), lambda: work(None))
        c.start(("ml", "c"), lambda: work(-1))
        with pytest.raises(RuntimeError, match="already running"):
            c.start(("ml", "a"), lambda: work(1.0))
        await asyncio.sleep(0.01)
        assert c.busy(("ml", "a")) and c.busy(("ml", "c")) and len(c) == 3
        gate.set()
        for key in (("ml", "a"), ("ml", "b"), ("ml", "c")):
            await c.wait(key)
        assert not c.busy(("ml", "a")) and len(c) == 0
        return sorted(done), peak, errors

    done, peak, errors = asyncio.run(run())
    assert peak == 2
    # what each asked; one that raised is counted and its job looked at again in a second
    assert done == [(("ml", "a"), 10.0), (("ml", "b"), None), (("ml", "c"), 1.0)]
    assert errors == [("ml", "c")]


def test_waiting_for_a_creation_that_does_not_end_cancels_it() -> None:
    async def run() -> tuple[bool, list[Any]]:
        done: list[Any] = []
        c = Creations(on_done=lambda k, r: done.append(k))
        c.start(("ml", "a"), lambda: asyncio.sleep(3600))
        await asyncio.sleep(0)
        await c.wait(("ml", "a"), timeout=0.05)
        return c.busy(("ml", "a")), done

    busy, done = asyncio.run(run())
    assert not busy and done == []  # cancelled: no next pass scheduled for a job that is going away


# ---- a pass hands its gang's creation off --------------------------------------------------------------------------

class GatedKube(Kube):
    """Creations wait for `gate`; requests are counted per kind of call."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.gate = asyncio.Event()
        self.writes = 0
        self.bulk: list[bool] = []

    async def write_status(self, namespace: str, name: str, patch: dict, rv: str) -> dict[str, Any]:
        self.writes += 1
        return await super().write_status(namespace, name, patch, rv)

    async def create(self, obj: dict[str, Any], bulk: bool = False) -> None:  # type: ignore[override]
        await self.gate.wait()
        self.bulk.append(bulk)
        self.created.append(obj)


def test_an_admitting_pass_writes_the_status_and_hands_the_creation_off() -> None:
    async def run() -> None:
        kube = GatedKube(_job("b"))
        events: list[str] = []
        next_pass: list[Any] = []
        cfg = reconcile.Reconciler(kube, Settings(poll_progress=False),  # type: ignore[arg-type]
                                   creations=Creations(on_done=lambda k, r: next_pass.append((k, r))))

        def emit(body: dict, type_: str, reason: str, message: str) -> None:
            events.append(reason)

        outcome = await cfg.reconcile("ml", "b", emit, Index())
        # the pass is over: the status names the attempt, nothing is created yet and no Event claims otherwise
        assert outcome.status is not None and outcome.status.attempt == 1 and outcome.status.phase == "Scheduling"
        assert kube.writes == 1 and kube.created == [] and events == []
        assert cfg.creations is not None and cfg.creations.busy(("ml", "b"))
        assert sorted(cfg.busy.reserved) == [("ml", "b-1-0")]  # its capacity is held meanwhile

        # a pass of the same job meanwhile (a pod event, the job's timer) does nothing at all
        again = await cfg.reconcile("ml", "b", emit, Index())
        assert again.status is None and kube.writes == 1 and kube.created == []

        kube.gate.set()
        await cfg.creations.wait(("ml", "b"))
        pods = [o["metadata"]["name"] for o in kube.created if o["kind"] == "Pod"]
        assert pods == ["b-1-0"] and all(kube.bulk)  # once, and behind the passes' requests
        assert events and next_pass and next_pass[0][0] == ("ml", "b")
        assert cfg.jobs.get("ml", "b").expected.known(1) == {"b-1-0"}  # type: ignore[union-attr]
        # (a later pass never plans it again)

    asyncio.run(run())


def test_a_refused_gang_in_a_creation_task_is_torn_down_and_its_reservation_released() -> None:
    from kubernetes.client.rest import ApiException

    class Refusing(GatedKube):
        gets = 0

        async def create(self, obj: dict[str, Any], bulk: bool = False) -> None:  # type: ignore[override]
            if obj["kind"] == "Pod":
                raise ApiException(status=403, reason="Forbidden")
            self.created.append(obj)

        async def get_job(self, namespace: str, name: str) -> dict[str, Any]:
            self.gets += 1
            return await super().get_job(namespace, name)

        async def delete_pods(self, *a: Any, **kw: Any) -> None:
            pass

        async def delete_configmaps(self, *a: Any, **kw: Any) -> None:
            pass

    async def run() -> None:
        kube = Refusing(_job("b"))
        creations = Creations()
        cfg = reconcile.Reconciler(kube, Settings(poll_progress=False), creations=creations)  # type: ignore[arg-type]
        await cfg.reconcile("ml", "b", lambda *a: None, Index())
        await creations.wait(("ml", "b"))
        # the refusal went the way it goes inside a pass: the job read again (after the pass's own read) and its
        # failure written
        assert kube.gets == 2 and kube.writes == 2
        assert cfg.busy.reserved == {}

    asyncio.run(run())


def test_pod_events_during_a_creation_bring_a_pass_soon_after_it_not_at_the_creations_own_delay() -> None:
    """The gang's pods may be created, bound and started while its creation still runs: those events queue nothing
    then (a pass would do nothing), and the creation's end brings the pass they asked for, not one in 10 s."""
    from seqtrain_operator.k8s.passes.workqueue import WorkQueue
    from seqtrain_operator.k8s.process import runtime

    async def run() -> tuple[int, float | None, float | None]:
        state = runtime.Runtime()
        passes: list[Any] = []

        async def process(key: Any) -> None:
            passes.append(key)

        state.queue = WorkQueue(process)
        creations = Creations(on_done=state._created)
        state.reconciler = reconcile.Reconciler(Kube(_job("b")), creations=creations)  # type: ignore[arg-type]
        key = ("ml", "b")
        state.reconciler.jobs.seen(*key, "uid-b")
        state.queue._active.add(key)
        gate = asyncio.Event()
        creations.start(key, lambda: gate.wait())
        await asyncio.sleep(0)
        state.poke_soon(*key)  # a pod of the gang was bound
        queued_meanwhile = len(state.queue) + len(state.queue._due)
        gate.set()  # the creation asks for no pass of its own (its work returned None)
        await creations.wait(key)
        due = state.queue._due.get(key)
        return queued_meanwhile, due, time.monotonic()

    queued, due, now = asyncio.run(run())
    assert queued == 0
    assert due is not None and due - now <= runtime.POD_BATCH_SECONDS
