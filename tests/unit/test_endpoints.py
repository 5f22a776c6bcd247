"""The trainer's progress and metrics endpoints are bounded (connections, idle time, request size), and the
operator reads at most a small progress body: a pod's user controls what listens there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from seqtrain.obs import httpserve
from seqtrain.obs.progress import ProgressReporter
from seqtrain.obs.prometheus import TrainerMetrics
from seqtrain_operator.k8s.progress.poll import MAX_BODY_BYTES, poll_progress, progress_url


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=60)


def _request(port: int, raw: bytes) -> bytes:
    with _connect(port) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _closed_by_server(s: socket.socket) -> bool:
    """Blocks until the server closes the connection (recv returns EOF); the 60 s socket timeout only bounds a
    test run against a server that never does."""
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False


@pytest.fixture
def reporter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(httpserve, "TIMEOUT_S", 0.5)
    monkeypatch.setattr(httpserve, "MAX_CONNECTIONS", 4)
    rep = ProgressReporter(str(tmp_path), total_steps=10, port=0, addr="127.0.0.1")
    rep.update(step=3)
    yield rep
    rep.close()


def test_an_idle_connection_is_closed_by_the_server(reporter):
    with _connect(reporter.port) as s:
        assert _closed_by_server(s)
    assert json.loads(_request(reporter.port, b"GET /progress HTTP/1.0\r\n\r\n").split(b"\r\n\r\n", 1)[1])["step"] == 3


def test_connections_over_the_limit_are_closed_without_a_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(httpserve, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(httpserve, "TIMEOUT_S", 600.0)  # the four idle clients keep their slots for the test
    monkeypatch.setattr(httpserve, "EVICT_AFTER_S", 600.0)  # and are not closed for newcomers (test_server_limits)
    rep = ProgressReporter(str(tmp_path), total_steps=10, port=0, addr="127.0.0.1")
    before = threading.active_count()
    idle = [_connect(rep.port) for _ in range(4)]
    extra = [_connect(rep.port) for _ in range(20)]
    try:
        assert all(_closed_by_server(s) for s in extra)  # the accept loop closed them: no thread, no wait
        assert threading.active_count() <= before + 4
        for s in idle:
            s.close()
        # the slots come back when the idle clients go: their threads see EOF, release the slot and end
        deadline = time.monotonic() + 60
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _request(rep.port, b"GET /progress HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200")
    finally:
        for s in idle + extra:
            s.close()
        rep.close()


def test_an_oversized_request_is_refused_without_reading_it_all(reporter):
    head = b"GET /progress HTTP/1.0\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n"
    assert _request(reporter.port, head).startswith(b"HTTP/1.0 431")
    assert _request(reporter.port, b"GET /" + b"p" * 10000 + b" HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 431")
    body = b"GET /progress HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello"
    assert _request(reporter.port, body).startswith(b"HTTP/1.0 413")


def test_the_metrics_server_is_bounded_too(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(httpserve, "TIMEOUT_S", 0.5)
    m = TrainerMetrics("j", rank=0)
    port = m.serve(0, addr="127.0.0.1")
    assert port
    try:
        assert b"seqtrain_steps_total" in _request(port, b"GET /metrics HTTP/1.0\r\n\r\n")
        big = b"GET /metrics HTTP/1.0\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n"
        assert _request(port, big).startswith(b"HTTP/1.0 431")
        with _connect(port) as s:
            assert _closed_by_server(s)
    finally:
        m.close()


def _serve_body(body: bytes, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):  # the client stopped reading
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server_class = type("Server6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6}) if ":" in host \
        else ThreadingHTTPServer
    server = server_class((host, 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("pad,expect", [(100, 4), (4 * MAX_BODY_BYTES, None)])
def test_the_operator_reads_at_most_a_small_progress_body(pad, expect):
    doc = json.dumps({"step": 4, "totalSteps": 10, "stopMessage": "x" * pad}).encode()
    server = _serve_body(doc)
    try:
        reported = asyncio.run(poll_progress("127.0.0.1", server.server_address[1], timeout=30))
    finally:
        server.shutdown()
        server.server_close()
    assert (reported.progress.step if reported.progress else None) == expect


def test_an_ipv6_pod_ip_is_bracketed_in_the_progress_url():
    assert progress_url("fd00:10:244::5", 8471) == "http://[fd00:10:244::5]:8471/progress"
    assert progress_url("10.0.0.5", 8471) == "http://10.0.0.5:8471/progress"


def test_the_operator_reads_progress_from_an_ipv6_pod():
    try:
        server = _serve_body(json.dumps({"step": 7, "totalSteps": 10}).encode(), host="::1")
    except OSError:
        pytest.skip("this host has no IPv6 loopback")
    try:
        reported = asyncio.run(poll_progress("::1", server.server_address[1], timeout=30))
    finally:
        server.shutdown()
        server.server_close()
    assert reported.progress is not None and reported.progress.step == 7
