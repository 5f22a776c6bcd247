"""A small HTTP server for read-only endpoints (the trainer's progress and Prometheus metrics, the operator's
`/metrics`), bounded so that no client can hold the process's resources:

- at most `max_connections` served at once. At that cap a new connection takes the place of the oldest one whose
  request has not arrived after `evict_after` seconds (a client that sends a request sends it in milliseconds;
  one that dribbles it is the likelier attacker); when there is none it is closed at once, without a thread;
- a deadline per connection, `timeout` seconds from accept for the whole exchange (request line, headers and
  reply), not per read: a client sending one byte a second is cut off at the deadline all the same;
- a request (line and headers) of at most `max_request_bytes`, GET only and no body (413), one request per
  connection (HTTP/1.0);
- no log line per connection: what was cut off or turned away is counted (`cut`, `turned_away`).

Both trainer endpoints listen on every interface of the pod without authentication (the operator and Prometheus
poll them); what they answer is public by design (step, loss, throughput). The chart's per-job NetworkPolicy narrows
who may connect at all (docs/user-guide.md "Security: what is trusted")."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_CONNECTIONS = 16
TIMEOUT_S = 10.0
EVICT_AFTER_S = 1.0
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


@dataclass
class _Conn:
    sock: socket.socket
    accepted: float  # time.monotonic()
    requested: bool = False  # the whole request has arrived: never evicted for a newcomer

    def cut(self) -> None:
        """Wake the connection's thread out of any read or write (it sees EOF or an error and ends)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class BoundedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], routes: dict[str, Route], max_connections: int | None = None,
                 timeout: float | None = None, max_request_bytes: int | None = None,
                 evict_after: float | None = None) -> None:
        self.routes = routes
        self.max_connections = max_connections or MAX_CONNECTIONS
        self.conn_timeout = timeout or TIMEOUT_S
        self.evict_after = EVICT_AFTER_S if evict_after is None else evict_after
        self.max_request_bytes = max_request_bytes or MAX_REQUEST_BYTES
        self._open: dict[int, _Conn] = {}  # by id(socket); guarded by _lock (accept loop and handler threads)
        self._lock = threading.Lock()
        self.cut = 0  # connections closed at their deadline or evicted for a newcomer
        self.turned_away = 0  # connections closed at accept: at the cap with none to evict
        super().__init__(addr, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._open) >= self.max_connections:
                stale = [c for c in self._open.values() if not c.requested and now - c.accepted >= self.evict_after]
                if not stale:  # over the cap: close now, in the accept loop, instead of starting one more thread
                    self.turned_away += 1
                    self.shutdown_request(request)
                    return
                victim = min(stale, key=lambda c: c.accepted)
                del self._open[id(victim.sock)]  # its thread ends at once; its slot is the newcomer's now
                victim.cut()
                self.cut += 1
            self._open[id(request)] = _Conn(request, now)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._lock:
            conn = self._open.get(id(request))
            if conn is not None and conn.sock is request:
                del self._open[id(request)]

    def requested(self, request: Any) -> None:
        with self._lock:
            if (conn := self._open.get(id(request))) is not None and conn.sock is request:
                conn.requested = True

    def service_actions(self) -> None:
        # serve_forever calls this every poll interval (0.5 s): connections past their deadline are cut here
        now = time.monotonic()
        with self._lock:
            late = [c for c in self._open.values() if now - c.accepted >= self.conn_timeout]
            for c in late:
                del self._open[id(c.sock)]
        for c in late:
            c.cut()
        self.cut += len(late)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up or was cut off is not the server's problem; no traceback on stderr


class _Handler(BaseHTTPRequestHandler):
    server: BoundedServer
    default_request_version = "HTTP/1.0"  # a status line on every answer, never HTTP/0.9's bare body

    def setup(self) -> None:
        self.timeout = self.server.conn_timeout  # per read too (StreamRequestHandler sets it on the socket)
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

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's refusals as one short JSON line; an unknown method (501) or HTTP version (505) is the
        client's error: 405 and 400, never a 5xx."""
        code = {501: 405, 505: 400}.get(code, code)
        self.close_connection = True
        for attr, value in (("request_version", "HTTP/1.0"), ("command", "GET"), ("requestline", "")):
            if not hasattr(self, attr):
                setattr(self, attr, value)
        text = message or self.responses.get(code, ("error",))[0]
        self._reply(code, "application/json", json.dumps({"error": text[:200]}).encode())

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.requested(self.request)
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
    start(server, what)
    return server


def start(server: BoundedServer, what: str) -> None:
    """Run `server` on a daemon thread (its accept loop also cuts connections at their deadline)."""
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.25}, name=f"seqtrain-{what.strip('/')}",
                     daemon=True).start()
