"""An aiohttp server speaking the Kubernetes REST API over the `Store`, on loopback, in a thread of its own.

Why not kmock's KubernetesEmulator (0.8): its lists report resourceVersion "...", watches ignore resourceVersion
(no resume, no 410 Gone), there are no label/field selectors, uids, generation, status subresource separation,
409 on stale resourceVersions, or ownerReference garbage collection: the very behaviour an operator's correctness
depends on (no duplicates after a restart, cascade cleanup, retried conflicts).

Served: discovery (/version, /api, /apis, group versions), list (labelSelector, fieldSelector), watch
(resourceVersion, timeoutSeconds, 410 Gone as an ERROR event), get, create, update (PUT), patch (merge, strategic
treated as merge, JSON patch), delete (finalizers, preconditions, propagationPolicy), deletecollection, and the
`/status` subresource. Fault injection: `inject()` makes matching requests fail with a status code, hang past the
client's timeout, or drop the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .store import ApiError, Resource, Store


@dataclass
class Fault:
    method: str  # "*" for any
    path: re.Pattern[str]
    status: int | None = None  # answer with this HTTP status (a Kubernetes Status body)
    delay: float = 0.0  # sleep before handling (past a client's timeout = a timeout)
    times: int = 1  # how many matching requests to hit; -1 = all
    drop: bool = False  # close the connection without an answer
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (self.method in ("*", method)) and bool(self.path.search(path)) and (self.times < 0 or self.hits < self.times)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    status: int = 0
    body: Any = None
    user: str = ""  # the bearer token: tells apart clients given different kubeconfigs (operator replicas)


@dataclass
class FakeKubernetes:
    """Start with `start()` (returns the base URL), stop with `stop()`; or use as a context manager."""

    store: Store = field(default_factory=Store)
    requests: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    url: str = ""
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: web.AppRunner | None = None
    _wake: list[asyncio.Event] = field(default_factory=list)
    _closing: bool = False

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> str:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            app = web.Application(client_max_size=16 * 2**20)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.shutdown())
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self.store.listeners.append(self._notify)
        self._thread = threading.Thread(target=run, name="fake-kube", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake Kubernetes API did not start within 10s")
        return self.url

    def stop(self) -> None:
        self._closing = True  # open watch streams end at their next wake-up
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_all)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> FakeKubernetes:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kubeconfig(self, path: str, token: str = "fake-token") -> str:
        """Write a kubeconfig pointing at this server and return its path. Tokens are not checked (loopback only),
        only recorded in `requests[].user`, so tests can tell which client sent what."""
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
               "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
               "users": [{"name": "fake", "user": {"token": token}}],
               "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}]}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f)
        return path

    # ---- fault injection and request log ---------------------------------------------------------------------

    def inject(self, method: str, path: str, *, status: int | None = None, delay: float = 0.0, times: int = 1,
               drop: bool = False) -> Fault:
        fault = Fault(method.upper(), re.compile(path), status=status, delay=delay, times=times, drop=drop)
        self.faults.append(fault)
        return fault

    def count(self, method: str, path_regex: str, status: int | None = None, user: str | None = None) -> int:
        pat = re.compile(path_regex)
        return sum(1 for r in list(self.requests) if r.method == method and pat.search(r.path)
                   and (status is None or r.status == status) and (user is None or r.user == user))

    # ---- watch wake-ups --------------------------------------------------------------------------------------

    def _notify(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        for ev in self._wake:
            ev.set()

    # ---- HTTP ------------------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        auth = request.headers.get("Authorization", "")
        rec = Request(request.method, path, dict(request.query), user=auth.removeprefix("Bearer ").strip())
        self.requests.append(rec)
        for fault in self.faults:
            if fault.matches(request.method, path):
                fault.hits += 1
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                if fault.drop:
                    assert request.transport is not None
                    request.transport.close()
                    rec.status = -1
                    return web.Response(status=500)
                if fault.status:
                    rec.status = fault.status
                    err = ApiError(fault.status, "InternalError" if fault.status >= 500 else "Conflict",
                                   f"injected fault: HTTP {fault.status}")
                    return web.json_response(err.status(), status=fault.status)
                break
        try:
            body = None
            if request.can_read_body:
                raw = await request.read()
                body = json.loads(raw) if raw else None
            rec.body = body
            resp = await self._route(request, path, body)
        except ApiError as err:
            resp = web.json_response(err.status(), status=err.code)
        except (ValueError, KeyError, TypeError) as exc:
            resp = web.json_response(ApiError(400, "BadRequest", f"bad request: {exc}").status(), status=400)
        rec.status = resp.status
        return resp

    async def _route(self, request: web.Request, path: str, body: Any) -> web.StreamResponse:
        parts = [p for p in path.split("/") if p]
        if parts == ["version"]:
            return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "platform": "linux/amd64"})
        if parts == ["api"]:
            return web.json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if parts == ["apis"]:
            return web.json_response(self._groups())
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        elif len(parts) == 2 and parts[0] == "apis":
            return web.json_response(self._group(parts[1]))
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
        if not rest:
            return web.json_response(self._resource_list(group, version))
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
            namespace, rest = rest[1], rest[2:]
        plural, name = rest[0], (rest[1] if len(rest) > 1 else None)
        sub = rest[2] if len(rest) > 2 else None
        r = self.store.resource(group, plural)
        if r.version != version:
            raise ApiError(404, "NotFound", f"{group}/{version} does not serve {plural}")
        if sub not in (None, "status"):
            raise ApiError(404, "NotFound", f"subresource {sub} is not served by the fake")
        if sub == "status" and not r.status_subresource:
            raise ApiError(404, "NotFound", f"{plural} has no status subresource")
        q = request.query
        m = request.method
        if name is None:
            if m == "GET" and q.get("watch") in ("true", "1"):
                return await self._watch(request, r, namespace)
            if m == "GET":
                items, rv = self.store.list(r, namespace, q.get("labelSelector", ""), q.get("fieldSelector", ""))
                return web.json_response({"apiVersion": r.api_version, "kind": f"{r.kind}List",
                                          "metadata": {"resourceVersion": rv}, "items": items})
            if m == "POST":
                return web.json_response(self.store.create(r, namespace, body or {}), status=201)
            if m == "DELETE":
                gone = self.store.delete_collection(r, namespace, q.get("labelSelector", ""), q.get("fieldSelector", ""))
                return web.json_response({"apiVersion": r.api_version, "kind": f"{r.kind}List",
                                          "metadata": {"resourceVersion": str(self.store.rv)}, "items": gone})
        else:
            if m == "GET":
                return web.json_response(self.store.get(r, namespace, name))
            if m == "PUT":
                return web.json_response(self.store.replace(r, namespace, name, body or {}, sub))
            if m == "PATCH":
                ctype = request.headers.get("Content-Type", "application/merge-patch+json")
                return web.json_response(self.store.patch(r, namespace, name, body, ctype, sub))
            if m == "DELETE" and sub is None:
                return web.json_response(self.store.delete(r, namespace, name, body))
        raise ApiError(405, "MethodNotAllowed", f"{m} is not supported on {path}")

    async def _watch(self, request: web.Request, r: Resource, namespace: str | None) -> web.StreamResponse:
        from .selectors import match_fields, match_labels

        q = request.query
        labels, fields = q.get("labelSelector", ""), q.get("fieldSelector", "")
        timeout = float(q.get("timeoutSeconds", 1800))
        start_rv = q.get("resourceVersion", "")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)

        async def send(type_: str, obj: dict[str, Any]) -> None:
            await resp.write(json.dumps({"type": type_, "object": obj}).encode() + b"\n")

        wake = asyncio.Event()
        self._wake.append(wake)
        try:
            with self.store.lock:
                if start_rv in ("", "0"):
                    # "Any" version: synthetic ADDED for everything that exists now, then changes after it.
                    items, rv = self.store.list(r, namespace, labels, fields)
                    last, backlog = int(rv), [("ADDED", i) for i in items]
                elif int(start_rv) < self.store.oldest_rv() - 1:
                    last, backlog = -1, []
                else:
                    last, backlog = int(start_rv), []
            if last < 0:
                gone = ApiError(410, "Expired", f"too old resource version: {start_rv} ({self.store.oldest_rv()})")
                await send("ERROR", gone.status())
                return resp
            for type_, obj in backlog:
                await send(type_, obj)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not self._closing:
                if request.transport is None or request.transport.is_closing():
                    break  # the client went away
                wake.clear()
                for ev in self.store.events_after(last, r):
                    last = ev.rv
                    ns_ok = not namespace or ev.object["metadata"].get("namespace") == namespace
                    if ns_ok and match_labels(labels, ev.object) and match_fields(fields, ev.object):
                        await send(ev.type, ev.object)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._wake.remove(wake)
        return resp

    # ---- discovery -------------------------------------------------------------------------------------------

    def _by_group(self) -> dict[str, list[Resource]]:
        out: dict[str, list[Resource]] = {}
        for r in list(self.store.resources.values()):
            out.setdefault(r.group, []).append(r)
        return out

    def _group_doc(self, group: str, resources: list[Resource]) -> dict[str, Any]:
        versions = sorted({r.version for r in resources})
        gv = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": gv, "preferredVersion": gv[0]}

    def _groups(self) -> dict[str, Any]:
        groups = [self._group_doc(g, rs) for g, rs in sorted(self._by_group().items()) if g]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def _group(self, group: str) -> dict[str, Any]:
        rs = self._by_group().get(group)
        if not rs:
            raise ApiError(404, "NotFound", f"group {group} not found")
        return {"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(group, rs)}

    def _resource_list(self, group: str, version: str) -> dict[str, Any]:
        rs = [r for r in self._by_group().get(group, []) if r.version == version]
        if not rs:
            raise ApiError(404, "NotFound", f"{group}/{version} not found")
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        items: list[dict[str, Any]] = []
        for r in sorted(rs, key=lambda r: r.plural):
            items.append({"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced,
                          "kind": r.kind, "verbs": verbs, "shortNames": list(r.short_names),
                          "categories": list(r.categories)})
            if r.status_subresource:
                items.append({"name": f"{r.plural}/status", "singularName": "", "namespaced": r.namespaced,
                              "kind": r.kind, "verbs": ["get", "patch", "update"]})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": items}


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll until predicate() is truthy; return its value. Fails with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}; last value: {last!r}")
