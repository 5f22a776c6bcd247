"""The admission webhook's server (k8s/webhook/review.py's `BoundedWebhookServer`: its bodies and answers) with the
connection limits every other server of the operator has, which kopf's aiohttp site lacks: aiohttp waits for a
request's head without a deadline, and takes any number of connections. The webhook port is the one port of the
operator's pods any client may reach (the API server's address cannot be selected by a NetworkPolicy), and it shares
the event loop and descriptors with the watches and the push endpoint.

- At most `MAX_CONNECTIONS` connections. At the cap a newcomer takes the place of the oldest connection that is not
  being answered and has waited `EVICT_AFTER_S` (an idle keep-alive connection, or one still sending its request);
  with none such it is closed at once.
- `DEADLINE_S` from a request's first byte to its answer: the head (bytes arriving while no request is being
  handled) is cut off at the deadline however slowly it trickles in, and the handler (the body is read there) is
  cancelled with a 408 when it is over.
- An idle keep-alive connection (no byte since its last answer) is closed after `IDLE_S`: longer than Go's
  90 s idle timeout, so the API server, which does not retry a POST, is the one that closes its idle connections.
- The TLS handshake has `DEADLINE_S` too.

kopf's own `WebhookServer.__call__` is followed (its SSL set-up, URL and certificate-renewal loop), with the site
replaced by `loop.create_server` over the guarded protocol.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp.web

from seqtrain_operator.k8s.webhook.review import BoundedWebhookServer

log = logging.getLogger("seqtrain.operator")

MAX_CONNECTIONS = 64
DEADLINE_S = 10.0
EVICT_AFTER_S = 1.0
IDLE_S = 120.0
SWEEP_S = 0.25


@dataclass(eq=False)
class _Conn:
    transport: asyncio.BaseTransport
    since: float  # accepted, or last answered
    receiving: float | None = None  # first byte of a request not yet handed to the handler
    busy: bool = False  # a request is being handled

    def waited(self, now: float) -> float:
        return now - (self.receiving if self.receiving is not None else self.since)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, seen by the guard on its way in and out."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard, self._inner = guard, inner
        self._conn: _Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conn = self._guard.admit(transport)
        self._inner.connection_made(transport)
        if self._conn is None:
            transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._conn is not None and not self._conn.busy and self._conn.receiving is None:
            self._conn.receiving = time.monotonic()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.forget(self._conn)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class ConnectionGuard:
    """The connections of one listening socket and their limits (see the module's docstring)."""

    def __init__(self) -> None:
        self.factory: Callable[[], asyncio.Protocol] | None = None  # aiohttp's, once its runner is set up
        self.max_connections, self.deadline, self.evict_after, self.idle = (MAX_CONNECTIONS, DEADLINE_S,
                                                                            EVICT_AFTER_S, IDLE_S)
        self._open: dict[int, _Conn] = {}  # by id(transport)
        self.cut = 0  # closed at a deadline, or for a newcomer
        self.turned_away = 0  # closed at accept: at the cap with none to close for it

    def protocol(self) -> asyncio.Protocol:
        assert self.factory is not None
        return _Guarded(self, self.factory())

    def admit(self, transport: asyncio.BaseTransport) -> _Conn | None:
        now = time.monotonic()
        if len(self._open) >= self.max_connections:
            idle = [c for c in self._open.values() if not c.busy and c.waited(now) >= self.evict_after]
            if not idle:
                self.turned_away += 1
                return None
            self._cut(min(idle, key=lambda c: c.receiving if c.receiving is not None else c.since))
        conn = _Conn(transport, now)
        self._open[id(transport)] = conn
        return conn

    def forget(self, conn: _Conn | None) -> None:
        if conn is not None and self._open.get(id(conn.transport)) is conn:
            del self._open[id(conn.transport)]

    def _cut(self, conn: _Conn) -> None:
        self.forget(conn)
        conn.transport.abort()
        self.cut += 1

    def sweep(self) -> None:
        now = time.monotonic()
        for conn in list(self._open.values()):
            if conn.busy:
                continue  # the middleware's deadline holds
            if (conn.receiving is not None and now - conn.receiving > self.deadline) or \
                    (conn.receiving is None and now - conn.since > self.idle):
                self._cut(conn)

    async def sweeping(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep()

    def close_all(self) -> None:
        for conn in list(self._open.values()):
            self._cut(conn)

    @aiohttp.web.middleware
    async def middleware(self, request: aiohttp.web.Request,
                         handler: Callable[[aiohttp.web.Request], Awaitable[aiohttp.web.StreamResponse]]
                         ) -> aiohttp.web.StreamResponse:
        conn = self._open.get(id(request.transport)) if request.transport is not None else None
        started = conn.receiving if conn is not None and conn.receiving is not None else time.monotonic()
        if conn is not None:
            conn.busy, conn.receiving = True, None
        try:
            left = max(0.0, self.deadline - (time.monotonic() - started))
            return await asyncio.wait_for(handler(request), left)
        except asyncio.TimeoutError:
            self.cut += 1
            return aiohttp.web.Response(status=408, text=f"the request took over {self.deadline:g}s\n",
                                        headers={"Connection": "close"})
        finally:
            if conn is not None:
                conn.busy, conn.since = False, time.monotonic()


class GuardedWebhookServer(BoundedWebhookServer):
    """k8s/webhook/review.py's server on a guarded listening socket."""

    guard: ConnectionGuard | None = None  # the running one (tests read its counts)

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:  # kopf's reviews.WebhookFn -> WebhookClientConfig
        from kopf._cogs.structs import reviews

        async def _serve_fn(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await self._serve(fn, request)

        loop = asyncio.get_running_loop()
        while True:
            cadata, context = self._build_ssl()
            path = self.path.rstrip("/") if self.path else ""
            guard = ConnectionGuard()
            app = aiohttp.web.Application(middlewares=[guard.middleware])
            app.add_routes([aiohttp.web.post(f"{path}/{{id:.*}}", _serve_fn)])
            # the guard closes idle connections first; after an answer, the rest of an unread body is drained for
            # at most 2 s (so the client reads the answer rather than a reset), not aiohttp's 10 s
            runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=IDLE_S + 60,
                                           lingering_time=2.0)
            await runner.setup()
            guard.factory = runner.server
            sweeper = asyncio.create_task(guard.sweeping())
            server: asyncio.AbstractServer | None = None
            try:
                addr = self.addr or None
                port = self.port or self._allocate_free_port()
                server = await loop.create_server(guard.protocol, addr, port, ssl=context, reuse_address=True,
                                                  reuse_port=True, ssl_handshake_timeout=DEADLINE_S if context else None)
                self.guard = guard
                schema = "http" if context is None else "https"
                host = self.host or self.DEFAULT_HOST or self._get_accessible_addr(self.addr)
                client_config = reviews.WebhookClientConfig(url=self._build_url(schema, host, port, self.path or ""))
                if cadata is not None:
                    client_config["caBundle"] = base64.b64encode(cadata).decode("ascii")
                yield client_config
                await self._WebhookServer__sleep_forever_or_until_ssl_files_change()  # type: ignore[attr-defined]
                log.debug("webhook: restarting with the renewed certificate files")
            finally:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
                if server is not None:
                    server.close()
                guard.close_all()
                await runner.cleanup()
