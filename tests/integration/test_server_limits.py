"""Every server the operator and the trainer run is bounded against a client that holds connections open: the
operator's progress push endpoint (k8s/progress/push.py), its `/metrics` (k8s/process/metrics.py) and the trainer's HTTP
server (seqtrain.obs.httpserve). Each test starts the real server on a loopback ephemeral port, opens as many slow
connections as the server takes (a header byte a second, the slowloris pattern), checks that valid requests are
still answered, and that the slow connections are closed by the server's deadline for the whole request (not per
read). No control plane; every loop is bounded and every server is stopped by the test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from seqtrain.obs import httpserve
from seqtrain.runtime.launch import free_port
from seqtrain_operator.k8s.pods.pushauth import job_token
from seqtrain_operator.k8s.process.metrics import OperatorMetrics
from seqtrain_operator.k8s.progress import push
from seqtrain_operator.k8s.progress.poll import MAX_BODY_BYTES
from seqtrain_operator.k8s.progress.push import PushedProgress

HOST = "127.0.0.1"
CAP = 8  # connections each server takes at once, for these tests
DEADLINE = 2.0  # seconds a connection may take for its whole request, for these tests
KEY = b"k" * 32
DOC = json.dumps({"step": 7, "totalSteps": 10, "attempt": 1, "updatedAt": "2026-01-01T00:00:00Z"}).encode()
PUSH_PATH = "/v1/progress/ml/gpt/u1/1"


def _exchange(port: int, chunks: list[bytes], pause: float = 0.0, timeout: float = 10.0) -> bytes:
    """Send `chunks` as separate writes (`pause` seconds apart) and read the answer until the server closes."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, chunk in enumerate(chunks):
            if i and pause:
                time.sleep(pause)
            s.sendall(chunk)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while not _complete(out) and (chunk := s.recv(65536)):
                out += chunk
        return out


def _complete(answer: bytes) -> bool:
    """A whole response is in (head and its Content-Length of body): a keep-alive server need not close."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.") else 0


_SEQUENCE = [0]  # every request another number: a repeated one is ignored (409) as a replay


def _push_request(body: bytes = DOC, token: str | None = None, path: str = PUSH_PATH,
                  length: int | None = None) -> bytes:
    token = token if token is not None else job_token(KEY, "ml", "gpt", "u1", 1)
    _SEQUENCE[0] += 1
    return (f"POST {path} HTTP/1.1\r\nHost: operator\r\nAuthorization: Bearer {token}\r\n"
            f"Seqtrain-Push-Sequence: {_SEQUENCE[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body) if length is None else length}\r\n\r\n"
            ).encode()


class Slowloris:
    """`n` connections that each send one byte of `head` per second (never the whole of it), for at most
    `give_up` seconds; records when the server closed each one."""

    def __init__(self, port: int, head: bytes, n: int, give_up: float) -> None:
        self.head, self.give_up = head, give_up
        self.socks = [socket.create_connection((HOST, port), timeout=5) for _ in range(n)]
        self.opened = time.monotonic()
        self.closed_at: dict[int, float] = {}
        self.ticks = 0
        self._tick = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _closed(self, i: int) -> None:
        self.closed_at.setdefault(i, time.monotonic() - self.opened)

    def _run(self) -> None:
        sent = 0
        while not self._stop.is_set() and time.monotonic() - self.opened < self.give_up:
            if len(self.closed_at) == len(self.socks):
                break
            for i, s in enumerate(self.socks):
                if i in self.closed_at:
                    continue
                try:
                    s.send(self.head[sent:sent + 1])
                except OSError:
                    self._closed(i)
            sent = min(sent + 1, len(self.head) - 3)  # never the blank line that ends the head
            with self._tick:
                self.ticks += 1
                self._tick.notify_all()
            # a second between bytes, while watching for the server closing any connection
            until = time.monotonic() + 1.0
            while (left := until - time.monotonic()) > 0 and not self._stop.is_set():
                live = [s for i, s in enumerate(self.socks) if i not in self.closed_at]
                readable, _, _ = select.select(live, [], [], min(left, 0.1)) if live else ([], [], [])
                for s in readable:
                    i = self.socks.index(s)
                    try:
                        if s.recv(4096) == b"":
                            self._closed(i)
                    except OSError:
                        self._closed(i)

    def wait_ticks(self, n: int) -> None:
        with self._tick:
            assert self._tick.wait_for(lambda: self.ticks >= n, timeout=30)

    def finish(self) -> list[int]:
        """Wait until every connection is closed or the slowloris gave up; the connections still open."""
        self._thread.join(self.give_up + 5)
        self._stop.set()
        for s in self.socks:
            s.close()
        return [i for i in range(len(self.socks)) if i not in self.closed_at]


@contextlib.contextmanager
def push_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, PushedProgress]]:
    monkeypatch.setattr(push, "MAX_CONNECTIONS", CAP, raising=False)
    monkeypatch.setattr(push, "DEADLINE_S", DEADLINE, raising=False)
    monkeypatch.setattr(push, "EVICT_AFTER_S", 0.5, raising=False)
    store, loop, ready, port = PushedProgress(), asyncio.new_event_loop(), threading.Event(), free_port()
    runner: list = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner.append(loop.run_until_complete(push.serve(store, KEY, port, HOST)))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield port, store
    finally:
        asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _slow_then_valid(port: int, head: bytes, valid: Callable[[], bytes], expect: int
                     ) -> tuple[list[int], list[bytes]]:
    """Hold CAP slow connections; while they are held, send three valid requests (each must be answered within
    the deadline: the socket's timeout); then the slow connections the server left open."""
    slow = Slowloris(port, head, CAP, give_up=4 * DEADLINE)
    answers = []
    try:
        slow.wait_ticks(2)  # every slow connection has sent two bytes and is older than the eviction age
        for _ in range(3):
            answers.append(_exchange(port, [valid()], timeout=DEADLINE))
    finally:
        still_open = slow.finish()
    assert [_status(a) for a in answers] == [expect] * 3, answers
    return still_open, answers


def test_pushes_are_served_while_slow_connections_are_held_and_those_are_cut_at_the_deadline(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    with push_server(monkeypatch) as (port, store):
        still_open, _ = _slow_then_valid(port, _push_request(), lambda: _push_request() + DOC, 204)
        assert still_open == [], f"slow connections {still_open} were never closed by the server"
        assert store.fresh("ml", "gpt", "u1", 30) is not None
    # one summary line at most, not one per connection
    assert len(caplog.records) <= 2, [r.getMessage() for r in caplog.records]


def test_a_push_split_over_two_writes_is_read_whole(monkeypatch):
    with push_server(monkeypatch) as (port, store):
        half = len(DOC) // 2
        answer = _exchange(port, [_push_request() + DOC[:half], DOC[half:]], pause=0.3)
        assert _status(answer) == 204, answer
        assert store.fresh("ml", "gpt", "u1", 30).progress.step == 7


@pytest.mark.parametrize(("request_bytes", "status"), [
    (_push_request(length=MAX_BODY_BYTES + 1), 413),  # refused before the body is read
    (_push_request(b"{" + b" " * MAX_BODY_BYTES + b"}") + b"{" + b" " * MAX_BODY_BYTES + b"}", 413),
    (_push_request(b"not json") + b"not json", 400),
    (_push_request(b"[" * 5000 + b"]" * 5000) + b"[" * 5000 + b"]" * 5000, 400),  # deeper than json can parse
    (_push_request(b'{"step": "x"}') + b'{"step": "x"}', 400),
    (_push_request(token="forged") + DOC, 403),
    (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", 400),  # a TLS hello
])
def test_bad_pushes_get_a_4xx(monkeypatch, request_bytes, status):
    with push_server(monkeypatch) as (port, store):
        assert _status(_exchange(port, [request_bytes])) == status
        assert store.fresh("ml", "gpt", "u1", 30) is None


def _limit_httpserve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpserve, "MAX_CONNECTIONS", CAP)
    monkeypatch.setattr(httpserve, "TIMEOUT_S", DEADLINE)
    monkeypatch.setattr(httpserve, "EVICT_AFTER_S", 0.5, raising=False)


def test_metrics_are_scraped_while_slow_connections_are_held_and_those_are_cut_at_the_deadline(monkeypatch):
    _limit_httpserve(monkeypatch)
    metrics, port = OperatorMetrics(), free_port()
    server = metrics.serve(port, HOST)
    try:
        head = b"GET /metrics HTTP/1.1\r\nHost: operator\r\nUser-Agent: slow\r\n\r\n"
        still_open, answers = _slow_then_valid(port, head, lambda: b"GET /metrics HTTP/1.1\r\nHost: operator\r\n\r\n", 200)
        assert all(b"seqtrain_jobs" in a for a in answers)
        assert still_open == [], f"slow connections {still_open} were never closed by the server"
    finally:
        if hasattr(server, "shutdown"):
            server.shutdown()
            server.server_close()


def test_the_trainers_server_cuts_a_connection_that_sends_a_byte_a_second(monkeypatch):
    _limit_httpserve(monkeypatch)
    server = httpserve.serve(0, HOST, {"/progress": lambda: (200, "application/json", b'{"step": 3}')}, "progress",
                             max_connections=CAP, timeout=DEADLINE)
    assert server is not None
    try:
        port = server.server_address[1]
        head = b"GET /progress HTTP/1.0\r\nHost: trainer\r\nUser-Agent: slow\r\n\r\n"
        still_open, answers = _slow_then_valid(port, head, lambda: b"GET /progress HTTP/1.0\r\n\r\n", 200)
        assert all(a.endswith(b'{"step": 3}') for a in answers)
        assert still_open == [], f"slow connections {still_open} were never closed by the server"
    finally:
        server.shutdown()
        server.server_close()


REVIEW = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                     "request": {"uid": "r1", "object": {}}}).encode()


def _review_request(body: bytes = REVIEW) -> bytes:
    return (f"POST /validate HTTP/1.1\r\nHost: operator\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@contextlib.contextmanager
def webhook_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The operator's webhook server (plain HTTP here: the limits are below TLS), answering every review allowed."""
    from seqtrain_operator.k8s.webhook import server as server_module

    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", CAP)
    monkeypatch.setattr(server_module, "DEADLINE_S", DEADLINE)
    monkeypatch.setattr(server_module, "EVICT_AFTER_S", 0.5)

    async def allow(data: dict, **_: object) -> dict:
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": data["request"]["uid"], "allowed": True}}

    loop, port, ready, stop = asyncio.new_event_loop(), free_port(), threading.Event(), threading.Event()
    server = server_module.GuardedWebhookServer(addr=HOST, port=port, insecure=True)

    async def run() -> None:
        async with server:  # as kopf runs it: leaving the context closes what it served
            await server(allow).__anext__()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
        # the handlers of connections the server aborted end once the loop runs them once more
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if pending:
            await asyncio.wait(pending, timeout=5)

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield port
    finally:
        stop.set()
        thread.join(10)
        loop.close()


def test_the_webhook_answers_reviews_while_slow_connections_are_held_and_cuts_them_at_the_deadline(monkeypatch):
    with webhook_server(monkeypatch) as port:
        still_open, answers = _slow_then_valid(port, _review_request(), lambda: _review_request(), 200)
        assert all(b'"allowed": true' in a for a in answers), answers
        assert still_open == [], f"slow connections {still_open} were never closed by the server"
        # a body that trickles in is cut at the deadline too (408), and a deep one is answered, not a 500
        head = _review_request()[:-len(REVIEW)]
        slow_body = _exchange(port, [head, REVIEW[:5]], timeout=4 * DEADLINE)
        assert _status(slow_body) in (0, 408), slow_body
        deep = _exchange(port, [_review_request(b"[" * 5000 + b"]" * 5000)])
        assert _status(deep) == 200 and b'"allowed": false' in deep
