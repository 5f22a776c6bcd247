"""Other tenants' pods (those without the job label) into the capacity ledger: a paged LIST, then a WATCH from its
resourceVersion, both label-selected (`!seqtrain.dev/job`) and field-selected (not terminated: a pod that ends
leaves the selection, and the watch says DELETED), each pod trimmed to its projection on arrival.

Why not kopf: kopf watches a resource with one label selector, and the pod watch is already selected on the job
label (only our pods reach kopf's handlers). This used to be a LIST of every foreign pod on the admission path,
every 5 s while any job waited (unpaginated); now admission reads the ledger and never waits on the API.

The watch runs in a thread of its own (the synchronous client streams), handing events to the event loop; a
watch that expires (410 Gone) or fails starts over with a LIST, which replaces what the ledger held of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from typing import Any

from kubernetes.watch.watch import iter_resp_lines

from seqtrain_operator.k8s import manifests as m
from seqtrain_operator.k8s import project
from seqtrain_operator.k8s.client import Kube
from seqtrain_operator.k8s.ledger import Ledger

log = logging.getLogger("seqtrain.operator")
SELECTOR = f"!{m.LABEL_JOB}"
NOT_TERMINATED = "status.phase!=Succeeded,status.phase!=Failed"
WATCH_SECONDS = 60  # one watch request's server-side timeout (then it is renewed from the last resourceVersion)


def _key(pod: dict[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


class ForeignPods:
    def __init__(self, kube: Kube, ledger: Ledger):
        self.kube, self.ledger = kube, ledger
        self.synced = asyncio.Event()  # the first LIST is in the ledger: admission may plan
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

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = 0.5
        while not self._stop.is_set():
            try:
                pods, rv = await self.kube.list_pods_paged(None, SELECTOR, NOT_TERMINATED, project=project.pod)
                self.lists += 1
                self.ledger.replace(pods, lambda held: held.job is None)
                self.synced.set()
                delay = 0.5
                while not self._stop.is_set() and rv:  # watch until it expires or fails, then LIST again
                    rv = await self._in_thread(loop, rv)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the ledger goes on from a fresh LIST
                log.warning("watching other tenants' pods failed (%s: %s); again in %.1fs", type(exc).__name__,
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

        threading.Thread(target=body, name="foreign-pods-watch", daemon=True).start()
        return fut

    def _watch(self, loop: asyncio.AbstractEventLoop, rv: str) -> str:
        """One watch request (in a thread): events go to the loop; returns the resourceVersion to go on from ("":
        LIST again)."""
        resp = self.kube.core.list_pod_for_all_namespaces(
            watch=True, resource_version=rv, label_selector=SELECTOR, field_selector=NOT_TERMINATED,
            allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS, _preload_content=False,
            _request_timeout=(10, WATCH_SECONDS + 30))
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
                        loop.call_soon_threadsafe(self.ledger.remove, _key(obj))
                    elif kind in ("ADDED", "MODIFIED"):
                        loop.call_soon_threadsafe(self.ledger.update, project.pod(obj))
        finally:
            resp.release_conn()
        return rv
