"""An in-memory mirror of one selection of pods or nodes: a paged LIST, then a WATCH from its resourceVersion, each
object trimmed to its projection (k8s/cache/project.py) on arrival; every LIST REPLACES what the mirror held, and what
vanished is reported as deleted.

Why: kopf's indexes drop an entry only on a DELETED event. A watch that is cut and cannot resume (410 Gone: the
resourceVersion is older than the apiserver's watch cache) is followed by a fresh LIST, and an object deleted in the
gap is simply absent from it: no DELETED event ever comes, and kopf kept it for ever (a pod deleted in the gap
kept its gang "running"; a node deleted in the gap kept attracting pins). Here a relist is a replace.

The watch runs in a thread of its own (the synchronous client streams), handing events to the event loop; a watch
that expires (410 Gone) or fails starts over with a LIST. A watch request that merely times out on the server
resumes from the last resourceVersion (the apiserver replays what happened meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.watch.watch import iter_resp_lines

from seqtrain_operator.k8s.api.client import Kube

log = logging.getLogger("seqtrain.operator")
WATCH_SECONDS = 60  # one watch request's server-side timeout (then it is renewed from the last resourceVersion)

Key = tuple[str, str]  # (namespace, name); nodes: ("", name)
Obj = dict[str, Any]


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


class Mirror:
    """`kind`: "pods" (cluster-wide) or "nodes". `on_upsert(obj, old)` / `on_delete(obj)` are called on the event
    loop for every change, a relist's vanished objects included; `objects` is the mirror itself."""

    def __init__(self, kube: Kube, kind: str, *, label_selector: str = "", field_selector: str = "",
                 project: Callable[[Mapping[str, Any]], Obj],
                 on_upsert: Callable[[Obj, Obj | None], None] | None = None,
                 on_delete: Callable[[Obj], None] | None = None, name: str | None = None):
        self.kube, self.kind = kube, kind
        self.label_selector, self.field_selector, self.project = label_selector, field_selector, project
        self.on_upsert, self.on_delete = on_upsert, on_delete
        self.name = name or kind
        self.objects: dict[Key, Obj] = {}
        self.synced = asyncio.Event()  # the first LIST is in: readers may trust the mirror
        self.lists = 0
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # ---- changes (on the event loop) ------------------------------------------------------------------------

    def upsert(self, obj: Obj) -> None:
        key = key_of(obj)
        old = self.objects.get(key)
        self.objects[key] = obj
        if self.on_upsert is not None:
            self.on_upsert(obj, old)

    def delete(self, key: Key) -> None:
        old = self.objects.pop(key, None)
        if old is not None and self.on_delete is not None:
            self.on_delete(old)

    def replace(self, objs: list[Obj]) -> None:
        """A LIST: these are all there is now. What the mirror held and the LIST lacks was deleted meanwhile."""
        fresh = {key_of(o): o for o in objs}
        for key in [k for k in self.objects if k not in fresh]:
            self.delete(key)
        for obj in fresh.values():
            self.upsert(obj)

    # ---- the LIST + WATCH loop --------------------------------------------------------------------------------

    async def _list(self) -> tuple[list[Obj], str]:
        if self.kind == "pods":
            return await self.kube.list_pods_paged(None, self.label_selector, self.field_selector,
                                                   project=self.project)
        return await self.kube.list_nodes_paged(self.label_selector, project=self.project)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = 0.5
        while not self._stop.is_set():
            try:
                objs, rv = await self._list()
                self.lists += 1
                self.replace(objs)
                self.synced.set()
                delay = 0.5
                while not self._stop.is_set() and rv:  # watch until it expires or fails, then LIST again
                    rv = await self._in_thread(loop, rv)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the mirror goes on from a fresh LIST
                log.warning("watching %s failed (%s: %s); listing again in %.1fs", self.name, type(exc).__name__,
                            exc, delay)
                await asyncio.sleep(delay)
                delay = min(30.0, delay * 2)

    def _in_thread(self, loop: asyncio.AbstractEventLoop, rv: str) -> asyncio.Future[str]:
        """`_watch` in a daemon thread (not the loop's executor: closing the loop would wait for the stream)."""
        fut: asyncio.Future[str] = loop.create_future()

        def settle(result: str | None, error: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result or "")

        def body() -> None:
            result, error = None, None
            try:
                result = self._watch(loop, rv)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: the operator stopped
                loop.call_soon_threadsafe(settle, result, error)

        threading.Thread(target=body, name=f"{self.name}-watch", daemon=True).start()
        return fut

    def _watch(self, loop: asyncio.AbstractEventLoop, rv: str) -> str:
        """One watch request (in a thread): events go to the loop; returns the resourceVersion to go on from ("":
        LIST again)."""
        kw: dict[str, Any] = {"watch": True, "resource_version": rv, "allow_watch_bookmarks": True,
                              "timeout_seconds": WATCH_SECONDS, "_preload_content": False,
                              "_request_timeout": (10, WATCH_SECONDS + 30)}
        if self.label_selector:
            kw["label_selector"] = self.label_selector
        if self.field_selector:
            kw["field_selector"] = self.field_selector
        fn = self.kube.core.list_pod_for_all_namespaces if self.kind == "pods" else self.kube.core.list_node
        resp = fn(**kw)
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    return ""
                if not line or line.isspace():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # 410 Gone: the resourceVersion is too old
                    return ""
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                with contextlib.suppress(RuntimeError):  # the loop is closed: the operator stopped
                    if kind == "DELETED":
                        loop.call_soon_threadsafe(self.delete, key_of(obj))
                    elif kind in ("ADDED", "MODIFIED"):
                        loop.call_soon_threadsafe(self.upsert, self.project(obj))
        finally:
            resp.release_conn()
        return rv
