"""A fault-injecting proxy in front of a real kube-apiserver: the apiserver's semantics stay real, the faults are
the ones a loaded, restarting or partitioned apiserver produces.

Every request is forwarded as it came (the client's bearer token included, so the apiserver authenticates and
authorizes the real caller) and recorded; responses, watch streams included, are streamed back chunk by chunk.
Rules, checked in the order they were added, make chosen requests (method, path regex, watch or not) fail:

- `status=409|500|503|429|...`: answered by the proxy with a Kubernetes `Status` body, never forwarded (the
  apiserver saw nothing, as when a write loses a race or the apiserver is overloaded); a 429 says
  `Retry-After: <retry_after>` (1 s unless the rule says);
- `delay=S`: held S seconds before forwarding (longer than the client's timeout: a timeout; the client gives up);
- `drop_after=N` (watches): N watch events are forwarded, then the connection is cut without the chunked
  terminator, as when an apiserver or a load balancer in between goes away;
- `gone=True` (watches): answered 200 with the single `ERROR` event (a `Status` with code 410, reason Expired) that
  the apiserver sends when the requested resourceVersion is older than its watch cache, then ended.

`drop_watches()` cuts the watch streams that are open now (an apiserver restart), whatever the rules.

A rule applies to `times` matching requests (None: all of them), skipping the first `after`; its `hits` count
how often it fired. `count()` counts recorded requests by method, path, status and watch.

    with FaultProxy(upstream="https://127.0.0.1:6443", ca_file=ca) as proxy:
        proxy.kubeconfig(path, token=sa_token)           # the client under test talks to the proxy
        rule = proxy.add_rule("POST", r"/namespaces/f/pods$", status=500, times=3)
        ...
        assert rule.hits == 3 and proxy.count("POST", r"/namespaces/f/pods$", status=201) == 2

The proxy listens on loopback over plain HTTP (tokens never leave the machine) unless given a certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yaml
from aiohttp import web

# Headers that belong to one connection, not to the message (RFC 9110 7.6.1), plus the ones aiohttp recomputes.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
        "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "content-encoding"}

_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict",
            410: "Expired", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
            503: "ServiceUnavailable", 504: "Timeout"}


@dataclass
class Rule:
    method: str  # HTTP method, or "*"
    path: re.Pattern[str]  # searched in the request path (no query)
    watch: bool | None = None  # True: only watch requests, False: only others, None: both
    status: int | None = None
    message: str = ""
    delay: float = 0.0
    drop_after: int | None = None
    gone: bool = False
    times: int | None = 1
    after: int = 0
    query: re.Pattern[str] | None = None  # searched in the query string (None: any)
    retry_after: float = 1.0  # a 429's Retry-After header, seconds
    seen: int = 0  # matching requests so far (the first `after` are let through)
    hits: int = 0  # requests this rule acted on

    def take(self, method: str, path: str, watch: bool, query: str = "") -> bool:
        """Whether this rule acts on the request (and counts it)."""
        if self.method not in ("*", method) or not self.path.search(path):
            return False
        if self.query is not None and not self.query.search(query):
            return False
        if self.watch is not None and self.watch != watch:
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        self.seen += 1
        if self.seen <= self.after:
            return False
        self.hits += 1
        return True


@dataclass
class Record:
    method: str
    path: str
    query: str
    watch: bool
    user_agent: str
    at: float  # time.monotonic() when the request arrived
    status: int = 0  # 0 until answered; the proxy's own code for an injected fault
    injected: bool = False
    body: Any = None  # the request's JSON body (creates, patches), when it had one
    answered: float | None = None  # time.monotonic() when the apiserver's answer (its headers) came back


def status_body(code: int, message: str = "", reason: str | None = None) -> dict[str, Any]:
    """A `Status` object as the apiserver sends it."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message or f"injected by the test proxy ({code})", "reason": reason or _REASONS.get(code, ""),
            "code": code}


def _is_watch(request: web.Request) -> bool:
    return request.query.get("watch", "").lower() in ("1", "true")


@dataclass
class FaultProxy:
    upstream: str  # the apiserver, e.g. https://127.0.0.1:6443
    ca_file: str | None = None  # the apiserver's CA (None: the system's trust store)
    client_cert: str | None = None  # forwarded with this client certificate (the caller's token still goes too)
    client_key: str | None = None
    listen_cert: str | None = None  # serve TLS with this certificate instead of plain HTTP
    listen_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    rules: list[Rule] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    url: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stop: asyncio.Event | None = None
    _error: BaseException | None = None
    _streams: dict[int, tuple[str, asyncio.Transport]] = field(default_factory=dict)

    # ---- rules and counts -----------------------------------------------------------------------------------

    def add_rule(self, method: str, path: str, *, watch: bool | None = None, status: int | None = None,
                 message: str = "", delay: float = 0.0, drop_after: int | None = None, gone: bool = False,
                 times: int | None = 1, after: int = 0, query: str | None = None, retry_after: float = 1.0) -> Rule:
        if sum(x is not None and x is not False for x in (status, drop_after, gone or None)) > 1:
            raise ValueError("a rule does one of status=, drop_after=, gone=")
        if (drop_after is not None or gone) and watch is False:
            raise ValueError("drop_after= and gone= act on watch streams; leave watch= unset or True")
        rule = Rule(method.upper(), re.compile(path), watch=True if (drop_after is not None or gone) else watch,
                    status=status, message=message, delay=delay, drop_after=drop_after, gone=gone, times=times,
                    after=after, query=re.compile(query) if query is not None else None, retry_after=retry_after)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear_rules(self) -> None:
        with self._lock:
            self.rules.clear()

    def requests(self, method: str | None = None, path: str | None = None, *, status: int | None = None,
                 watch: bool | None = None, since: float | None = None) -> list[Record]:
        pat = re.compile(path) if path else None
        with self._lock:
            recs = list(self.records)
        return [r for r in recs if (method is None or r.method == method.upper())
                and (pat is None or pat.search(r.path)) and (status is None or r.status == status)
                and (watch is None or r.watch == watch) and (since is None or r.at >= since)]

    def count(self, method: str | None = None, path: str | None = None, *, status: int | None = None,
              watch: bool | None = None, since: float | None = None) -> int:
        return len(self.requests(method, path, status=status, watch=watch, since=since))

    def drop_watches(self, path: str | None = None) -> int:
        """Cut the watch streams open now (whose path matches), as an apiserver restart does; returns how many.
        New watches go on unhindered (unless a rule says otherwise)."""
        pat = re.compile(path) if path else None
        with self._lock:
            # Forget the victims now: their handlers unregister only once the aborted stream unwinds, and a caller
            # asking again right after (as a test does) must not count a stream already cut.
            keys = [k for k, (p, _) in self._streams.items() if pat is None or pat.search(p)]
            victims = [self._streams.pop(k)[1] for k in keys]
        if self._loop is not None:
            for t in victims:
                self._loop.call_soon_threadsafe(t.abort)
        return len(victims)

    def kubeconfig(self, path: str, token: str, namespace: str = "default") -> str:
        """A kubeconfig that sends `token` to this proxy; returns `path`."""
        cluster: dict[str, Any] = {"server": self.url}
        if self.listen_cert:
            cluster["certificate-authority"] = self.listen_cert
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "proxy",
               "clusters": [{"name": "proxy", "cluster": cluster}],
               "users": [{"name": "proxy", "user": {"token": token}}],
               "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy",
                                                           "namespace": namespace}}]}
        with open(path, "w") as f:
            yaml.safe_dump(doc, f)
        return path

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(30) or self._error is not None:
            raise RuntimeError(f"fault proxy did not start: {self._error}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, ready: threading.Event) -> None:
        try:
            asyncio.run(self._serve(ready))
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            ready.set()

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        upstream_ssl: ssl.SSLContext | bool = False
        if self.upstream.startswith("https"):
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.client_cert:
                ctx.load_cert_chain(self.client_cert, self.client_key)
            upstream_ssl = ctx
        listen_ssl = None
        if self.listen_cert:
            listen_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            listen_ssl.load_cert_chain(self.listen_cert, self.listen_key)
        # No pool limit: every watch holds one upstream connection for its whole life.
        connector = aiohttp.TCPConnector(limit=0, ssl=upstream_ssl)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # Stopping does not wait for open streams to end (aiohttp's default waits up to 60 s, and a watch the
        # operator left open holds it that long): their handlers are cancelled after a second.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, ssl_context=listen_ssl)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"{'https' if listen_ssl else 'http'}://{self.host}:{port}"
        ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await self._session.close()

    # ---- the proxy ------------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        watch = _is_watch(request)
        body = await request.read()
        rec = Record(request.method, request.path, request.query_string, watch,
                     request.headers.get("User-Agent", ""), time.monotonic())
        if body and (request.content_type.endswith("json") or body[:1] in (b"{", b"[")):  # some clients send none
            with contextlib.suppress(ValueError):
                rec.body = json.loads(body)
        with self._lock:
            self.records.append(rec)
            rule = next((r for r in self.rules if r.take(request.method, request.path, watch, request.query_string)), None)
        if rule is not None and rule.delay:
            await asyncio.sleep(rule.delay)  # the client may give up meanwhile: this handler is then cancelled
        if rule is not None and rule.status is not None:
            rec.status, rec.injected = rule.status, True
            headers = {"Retry-After": f"{rule.retry_after:g}"} if rule.status == 429 else None
            return web.json_response(status_body(rule.status, rule.message), status=rule.status, headers=headers)
        if rule is not None and rule.gone:
            rec.status, rec.injected = 200, True
            rv = request.query.get("resourceVersion", "0")
            event = {"type": "ERROR", "object": status_body(
                410, rule.message or f"too old resource version: {rv} ({int(rv or 0) + 1000})", "Expired")}
            return web.Response(body=json.dumps(event).encode() + b"\n", content_type="application/json")
        return await self._forward(request, body, rec, rule.drop_after if rule is not None else None)

    async def _forward(self, request: web.Request, body: bytes, rec: Record,
                       drop_after: int | None) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = self.upstream.rstrip("/") + request.rel_url.raw_path_qs
        try:
            # No Content-Type invented for a body that came without one (aiohttp would say octet-stream, which the
            # apiserver refuses; without one it reads JSON), and no Accept-Encoding: the apiserver gzips large
            # responses when asked, and the proxy passes bodies through as they are (and reads watch events).
            upstream = await self._session.request(request.method, url, headers=headers, data=body or None,
                                                   allow_redirects=False,
                                                   skip_auto_headers=("Content-Type", "Accept-Encoding"))
        except (aiohttp.ClientError, OSError) as exc:
            rec.status = 502
            return web.json_response(status_body(502, f"proxy: upstream unreachable: {exc}", "ServiceUnavailable"),
                                     status=502)
        async with upstream:
            rec.status, rec.answered = upstream.status, time.monotonic()
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP:
                    resp.headers.add(k, v)
            await resp.prepare(request)
            if drop_after is not None:
                rec.injected = True
                for _ in range(drop_after):
                    line = await upstream.content.readline()
                    if not line:
                        break
                    await resp.write(line)
                # Cut the connection mid-stream: no terminating chunk, as when the far end dies.
                if request.transport is not None:
                    request.transport.abort()
                return resp
            key = id(resp)
            if rec.watch and request.transport is not None:
                with self._lock:
                    self._streams[key] = (request.path, request.transport)  # type: ignore[assignment]
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            finally:
                with self._lock:
                    self._streams.pop(key, None)
            return resp
