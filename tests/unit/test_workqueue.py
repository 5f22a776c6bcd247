"""The operator's keyed work queue (k8s/passes/workqueue.py): what a job's passes may rely on."""

from __future__ import annotations

import asyncio

import pytest

from seqtrain_operator.k8s.passes import workqueue
from seqtrain_operator.k8s.passes.workqueue import WorkQueue

HANG = 10.0  # a guard against a hang, never a speed requirement


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG))


async def _until(cond, step: float = 0.005) -> None:
    while not cond():
        await asyncio.sleep(step)


def test_adds_of_a_queued_key_coalesce_into_one_pass():
    async def main():
        passes: list[str] = []

        async def process(key):
            passes.append(key)

        q = WorkQueue(process, workers=2)
        for key in ("a", "b"):
            q._active.add(key)
        for _ in range(5):  # before any worker runs: one queued entry per key
            q.add("a")
        q.add("b")
        q.start()
        await _until(lambda: q.passes == 2)
        await asyncio.sleep(0.05)
        await q.stop()
        return passes

    assert sorted(run(main())) == ["a", "b"]


def test_a_key_added_while_its_pass_runs_gets_exactly_one_more_pass_never_two_at_once():
    async def main():
        release, started = asyncio.Event(), asyncio.Event()
        concurrent, most, passes = 0, 0, 0

        async def process(key):
            nonlocal concurrent, most, passes
            concurrent += 1
            most = max(most, concurrent)
            passes += 1
            if passes == 1:
                started.set()
                await release.wait()
            concurrent -= 1

        q = WorkQueue(process, workers=4)
        q.start()
        q.activate("job")
        await started.wait()
        for _ in range(3):  # changes seen while the first pass runs: it may have read the cluster before them
            q.add("job")
        release.set()
        await _until(lambda: q.passes == 2)
        await asyncio.sleep(0.05)
        await q.stop()
        return passes, most

    assert run(main()) == (2, 1)


def test_no_more_passes_in_flight_than_workers_whatever_the_number_of_keys():
    async def main():
        release = asyncio.Event()
        concurrent, most = 0, 0

        async def process(key):
            nonlocal concurrent, most
            concurrent += 1
            most = max(most, concurrent)
            await release.wait()
            concurrent -= 1

        q = WorkQueue(process, workers=3)
        q.start()
        for i in range(20):
            q.activate(i)
        await _until(lambda: concurrent == 3)
        await asyncio.sleep(0.05)  # the other 17 stay queued
        queued = len(q)
        release.set()
        await _until(lambda: q.passes == 20)
        await q.stop()
        return most, queued

    assert run(main()) == (3, 17)


def test_the_delay_a_pass_returns_brings_its_key_back_and_none_ends_polling():
    async def main():
        passes = 0

        async def process(key):
            nonlocal passes
            passes += 1
            return 0.01 if passes < 3 else None

        q = WorkQueue(process, workers=1)
        q.start()
        q.activate("job")
        await _until(lambda: passes == 3)
        await asyncio.sleep(0.1)
        await q.stop()
        return passes

    assert run(main()) == 3


def test_a_new_delay_replaces_the_earlier_timer_of_the_key():
    async def main():
        q = WorkQueue(lambda key: asyncio.sleep(0), workers=1)
        q._active.add("job")
        q.start()
        q.schedule("job", 3600)
        q.schedule("job", 0.01)  # sooner: the timer task must not sleep on the hour-long one
        await _until(lambda: q.passes == 1)
        q.schedule("job", 0.01)
        q.schedule("job", 3600)  # later: the earlier timer is stale now and must not fire
        await asyncio.sleep(0.1)
        await q.stop()
        return q.passes

    assert run(main()) == 1


def test_a_failing_pass_is_retried_with_a_backoff_that_doubles(monkeypatch):
    monkeypatch.setattr(workqueue, "BACKOFF_BASE", 0.001)

    async def main():
        errors: list[tuple[str, str, float]] = []
        calls = 0

        async def process(key):
            nonlocal calls
            calls += 1
            if calls <= 3:
                raise RuntimeError(f"boom {calls}")
            return None

        q = WorkQueue(process, workers=1, on_error=lambda key, exc, delay: errors.append((key, str(exc), delay)))
        q.start()
        q.activate("job")
        await _until(lambda: calls == 4)
        await q.stop()
        return errors

    errors = run(main())
    assert [e[1] for e in errors] == ["boom 1", "boom 2", "boom 3"]
    delays = [e[2] for e in errors]
    assert delays == sorted(delays) and delays[1] == 2 * delays[0] and delays[2] == 2 * delays[1]


def test_the_backoff_is_capped():
    assert workqueue.backoff(1) == workqueue.BACKOFF_BASE * 2
    assert workqueue.backoff(100) == workqueue.BACKOFF_CAP


def test_inactive_keys_get_no_pass_and_deactivate_waits_for_the_pass_in_flight():
    async def main():
        release, started = asyncio.Event(), asyncio.Event()
        finished: list[str] = []

        async def process(key):
            started.set()
            await release.wait()
            finished.append(key)
            return 0.0  # would come back at once if it were still active

        q = WorkQueue(process, workers=2)
        q.start()
        q.add("stranger")  # never activated: a paused operator's pod events
        q.activate("job")
        await started.wait()
        gone = asyncio.ensure_future(q.deactivate("job"))
        await asyncio.sleep(0.05)
        waited = not gone.done()
        release.set()
        await gone
        await asyncio.sleep(0.05)
        await q.stop()
        return waited, finished, q.passes

    assert run(main()) == (True, ["job"], 1)


def test_deactivate_cancels_a_pass_that_outlives_its_timeout():
    async def main():
        started = asyncio.Event()
        cancelled = asyncio.Event()

        async def process(key):
            if key != "job":
                return None
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        q = WorkQueue(process, workers=1)
        q.start()
        q.activate("job")
        await started.wait()
        await q.deactivate("job", timeout=0.05)
        await cancelled.wait()
        q.activate("other")  # the worker survived its pass's cancellation
        await _until(lambda: q.passes == 2)
        await q.stop()
        return q.running("job")

    assert run(main()) is False


def test_workers_must_be_at_least_one():
    with pytest.raises(ValueError, match="workers must be at least 1"):
        WorkQueue(lambda key: asyncio.sleep(0), workers=0)


def test_add_after_batches_a_burst_of_events_into_one_pass_and_never_delays_a_sooner_one():
    async def main():
        passes: list[float] = []
        loop = asyncio.get_running_loop()

        async def process(key):
            passes.append(loop.time())
            return None  # no timer of its own: only events bring it back

        q = WorkQueue(process, workers=2)
        q.start()
        q._active.add("job")
        t0 = loop.time()
        for _ in range(20):  # a gang's pods created, bound, started: one pass for all of them
            q.add_after("job", 0.2)
        await _until(lambda: q.passes == 1)
        await asyncio.sleep(0.3)  # nothing else was due
        batched = len(passes), passes[0] - t0
        q.schedule("job", 0.05)  # due sooner (a pass asked for it): a later batch does not postpone it
        q.add_after("job", 5.0)
        await _until(lambda: q.passes == 2)
        await q.stop()
        return batched, passes[1] - passes[0]

    (count, after), gap = run(main())
    assert count == 1 and after >= 0.2
    assert gap < 5.0
