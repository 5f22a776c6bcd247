"""The operator's API client (k8s/api/client.py) without a cluster: the token bucket on a fake clock, Retry-After read
from an ApiException, and `Kube._call` waiting what a 429 asks (the fault proxy's 429s on the real control plane:
tests/integration/test_operator_resilience.py::test_429_retry_after_is_honoured_and_the_job_still_runs)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from seqtrain_operator.k8s.api import client as kc


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_lets_a_burst_through_then_spaces_requests_at_qps() -> None:
    clock = Clock()
    b = kc.Budget(qps=10.0, burst=3, clock=clock)
    assert [b.delay() for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst, at once
    # then each caller waits one token's worth longer than the one before it (tokens taken while waiting count)
    assert [round(b.delay(), 6) for _ in range(3)] == [0.1, 0.2, 0.3]
    clock.now += 0.3  # those three have gone out; the bucket is empty again, not in credit
    assert round(b.delay(), 6) == 0.1


def test_the_bucket_refills_at_qps_up_to_burst_only() -> None:
    clock = Clock()
    b = kc.Budget(qps=2.0, burst=4, clock=clock)
    for _ in range(4):
        b.delay()
    clock.now += 1.0  # two tokens back
    assert [b.delay() for _ in range(2)] == [0.0, 0.0]
    assert b.delay() == pytest.approx(0.5)
    clock.now += 3600  # idle for an hour: still only `burst` at once
    assert [b.delay() for _ in range(4)] == [0.0] * 4
    assert b.delay() == pytest.approx(0.5)


def test_qps_zero_is_no_limit() -> None:
    b = kc.Budget(qps=0.0, burst=0, clock=Clock())
    assert all(b.delay() == 0.0 for _ in range(10_000))


def _exc(status: int, retry_after: str | None) -> ApiException:
    exc = ApiException(status=status, reason="TooManyRequests")
    exc.headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return exc


@pytest.mark.parametrize(("value", "seconds"), [("3", 3.0), ("0.5", 0.5), (None, None), ("soon", None)])
def test_retry_after_is_read_from_the_answer(value: str | None, seconds: float | None) -> None:
    assert kc._retry_after(_exc(429, value)) == seconds


def test_a_429_waits_its_retry_after_instead_of_the_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(kc.asyncio, "sleep", sleep)
    kube = kc.Kube(client.ApiClient(), backoff=0.2, qps=0)
    answers: list[Any] = [_exc(429, "2"), _exc(500, None), _exc(429, "120"), b'{"ok": true}']

    def call(**_: Any) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    try:
        assert asyncio.run(kube._call(call)) == {"ok": True}
    finally:
        kube._pool.shutdown()
    # Retry-After over the backoff (0.2, then 0.4 for the 500), capped at 30 s for a server asking too much
    assert slept == [2.0, 0.4, 30.0] and kube.requests == 4


def _status_writes(monkeypatch: pytest.MonkeyPatch, answers: list[Any]) -> kc.Conflict:
    """The Conflict a status write raises when the API answers `answers` in turn."""
    async def sleep(seconds: float) -> None:
        return None

    monkeypatch.setattr(kc.asyncio, "sleep", sleep)
    kube = kc.Kube(client.ApiClient(), backoff=0.2, qps=0)

    def patch(*_: Any, **__: Any) -> Any:
        raise answers.pop(0)

    monkeypatch.setattr(kube.custom, "patch_namespaced_custom_object_status", patch)
    try:
        with pytest.raises(kc.Conflict) as raised:
            asyncio.run(kube.write_status("ns", "job", {"phase": "Scheduling"}, "7"))
    finally:
        kube._pool.shutdown()
    return raised.value


def test_a_conflict_after_a_timed_out_attempt_says_the_write_may_have_been_applied(monkeypatch) -> None:
    from urllib3.exceptions import ReadTimeoutError

    # The first PATCH reached the server and was applied, but its answer never came; the retry's precondition (the
    # resourceVersion read before) then fails against our own write. The 3000-job run released the gang's capacity
    # on such a 409 while its status already named the placement: 8 gangs pinned to full nodes.
    timed_out = ReadTimeoutError(None, "/apis", "Read timed out.")  # type: ignore[arg-type]
    assert _status_writes(monkeypatch, [timed_out, _exc(409, None)]).unsure is True
    # a 429 is refused before anything runs: a conflict after it is someone else's change, as without retries
    assert _status_writes(monkeypatch, [_exc(429, "1"), _exc(409, None)]).unsure is False
    assert _status_writes(monkeypatch, [_exc(409, None)]).unsure is False


def test_the_answer_is_read_in_the_api_thread_which_hands_its_connection_back() -> None:
    # urllib3 returns a connection to its pool when the body has been read. Read on the event loop, a busy loop held
    # the connections of answers it had not got to while the freed threads opened more: the 1000-job run logged
    # "Connection pool is full, discarding connection" hundreds of times, and the loop waited on sockets.
    import threading

    class Answer:
        read_in: str | None = None

        @property
        def data(self) -> bytes:
            Answer.read_in = threading.current_thread().name
            return b'{"kind": "Pod"}'

    kube = kc.Kube(client.ApiClient(), qps=0)
    try:
        assert asyncio.run(kube._call(lambda **_: Answer())) == {"kind": "Pod"}
    finally:
        kube._pool.shutdown()
    assert Answer.read_in is not None and Answer.read_in.startswith("kube-api"), Answer.read_in
