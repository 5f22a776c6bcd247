"""A small HTTP server for the trainer's read-only endpoints (progress, Prometheus metrics), bounded so that no
client can hold the trainer's resources: at most `max_connections` served at once (more are closed at once,
without a thread), each connection closed after `timeout` seconds of silence, a request (line and headers) of at
most `max_request_bytes`, GET only and no body, one request per connection (HTTP/1.0).

Both endpoints listen on every interface of the pod without authentication (the operator and Prometheus poll
them); what they answer is public by design (step, loss, throughput). The chart's per-job NetworkPolicy narrows
who may connect at all (docs/user-guide.md "Security: what is trusted")."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_CONNECTIONS = 16
TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 8192

# path -> (status, content type, body); called per request, so it reads the current state
Route = Callable[[], tuple[int, str, bytes]]


class _TooLarge(Exception):
    pass


class _CappedReader:
    """The request stream, cut off after `budget` bytes (http.server alone reads up to 100 lines of 64 KiB)."""

    def __init__(self, raw: Any, budget: int) -> None:
        self._raw, self._left = raw, budget

    def _take(self, data: bytes) -> bytes:
        self._left -= len(data)
        if self._left < 0:
            raise _TooLarge
        return data

    def readline(self, size: int = -1) -> bytes:
        cap = self._left + 1 if size < 0 else min(size, self._left + 1)
        return self._take(self._raw.readline(cap))

    def read(self, size: int = -1) -> bytes:
        cap = self._left + 1 if size < 0 else min(size, self._left + 1)
        return self._take(self._raw.read(cap))

    def close(self) -> None:
        self._raw.close()


class BoundedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], routes: dict[str, Route], max_connections: int | None = None,
                 timeout: float | None = None, max_request_bytes: int | None = None) -> None:
        self.routes = routes
        self.slots = threading.BoundedSemaphore(max_connections or MAX_CONNECTIONS)
        self.conn_timeout = timeout or TIMEOUT_S
        self.max_request_bytes = max_request_bytes or MAX_REQUEST_BYTES
        super().__init__(addr, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Over the limit: close now, in the accept loop, instead of starting one more thread.
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up or timed out is not the trainer's problem; no traceback on stderr


class _Handler(BaseHTTPRequestHandler):
    server: BoundedServer

    def setup(self) -> None:
        self.timeout = self.server.conn_timeout  # StreamRequestHandler sets it on the socket
        super().setup()
        self.rfile = _CappedReader(self.rfile, self.server.max_request_bytes)  # type: ignore[assignment]

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except _TooLarge:
            self.close_connection = True
            for attr, value in (("request_version", "HTTP/1.0"), ("command", "GET"), ("requestline", "")):
                if not hasattr(self, attr):
                    setattr(self, attr, value)
            self._reply(431, "application/json", b'{"error": "request too large"}')
        except (TimeoutError, OSError):
            self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if (self.headers.get("Content-Length") or "0").strip() != "0":
            self._reply(413, "application/json", b'{"error": "GET takes no body"}')
            return
        route = self.server.routes.get(self.path.split("?")[0])
        if route is None:
            self._reply(404, "application/json",
                        ('{"error": "not found; try ' + ", ".join(self.server.routes) + '"}').encode())
            return
        self._reply(*route())

    def _reply(self, code: int, ctype: str, body: bytes) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - polled every few seconds: stay quiet
        pass


def serve(port: int, addr: str, routes: dict[str, Route], what: str, **limits: Any) -> BoundedServer | None:
    """Serve `routes` on a daemon thread; None (with a warning) when the port is taken: training goes on."""
    try:
        server = BoundedServer((addr, port), routes, **limits)
    except OSError as exc:
        print(f"seqtrain: warning: cannot serve {what} on port {port}: {exc}", file=sys.stderr)
        return None
    threading.Thread(target=server.serve_forever, name=f"seqtrain-{what.strip('/')}", daemon=True).start()
    return server
