"""The few Kubernetes API calls the operator makes, with retries, returning plain dicts.

The official (synchronous) client runs in worker threads. Transient failures (HTTP 5xx, 429, timeouts, dropped
connections) are retried with capped exponential backoff; 409 AlreadyExists on create counts as success (the
object is there: idempotent) only when the object there is the same job's (its job-uid label or ownerReference:
a deleted job's namesake is raised as `NameTaken`); 404 on delete likewise. A 409 Conflict on the status write is raised as `Conflict`
so the caller re-reads and decides again instead of overwriting a newer object.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client, config
from kubernetes.client import rest
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from seqtrain.spec import API_GROUP, API_VERSION, PLURAL
from seqtrain_operator.k8s.owner import owner_uid

log = logging.getLogger("seqtrain.operator")
_VERSION = API_VERSION.split("/")[1]


PAGE = 500  # objects per LIST response


class Conflict(Exception):
    """The object changed since it was read (HTTP 409 on a write with a resourceVersion precondition). `unsure`: an
    earlier attempt of the same write timed out or lost its connection, so the change may have been that attempt's
    own: the write may have been applied."""

    def __init__(self, message: str, unsure: bool = False):
        super().__init__(message)
        self.unsure = unsure


class NameTaken(Exception):
    """Create answered 409, and the object of that name belongs to another SeqTrainJob (a deleted job of the same
    name whose objects are still going), or vanished before it could be read. `uid`: that object's own uid (None:
    gone), `terminating`: it is being deleted already."""

    def __init__(self, obj: dict[str, Any], uid: str | None, terminating: bool, owner: str | None):
        self.api_version, self.kind, self.name = obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
        super().__init__(f"{self.kind} {self.name} belongs to an earlier SeqTrainJob of the same name (uid {owner})")
        self.uid, self.terminating, self.owner = uid, terminating, owner


class Unavailable(Exception):
    """The API server kept failing after every retry."""


def api_message(exc: ApiException) -> str:
    """The apiserver's own explanation (Status.message), e.g. `exceeded quota: q, requested: pods=1, ...`."""
    try:
        body = json.loads(exc.body or "")
        if isinstance(body, dict) and body.get("message"):
            return f"{exc.status} {body.get('reason') or exc.reason}: {body['message']}"
    except (TypeError, ValueError):
        pass
    return f"{exc.status} {exc.reason}"


def load_config() -> client.ApiClient:
    """In-cluster service account when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:
        # KUBECONFIG is read here, not at import time (the client's default is frozen when it is imported).
        path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or None
        return config.new_client_from_config(config_file=path)


SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def cluster_config_problem() -> str | None:
    """None when a cluster is configured (what `load_config` would use loads); else one line saying what was
    looked for and how to point the operator at a cluster. Checked before kopf starts, which would otherwise
    print a client traceback and keep retrying forever."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(SERVICE_ACCOUNT_TOKEN):
        return None
    raw = os.environ.get("KUBECONFIG", "")
    paths = [p for p in raw.split(os.pathsep) if p]
    home = os.path.expanduser("~/.kube/config")
    path = paths[0] if paths else home
    try:
        config.new_client_from_config(config_file=path)
        return None
    except Exception as exc:  # noqa: BLE001 - any unreadable kubeconfig (YAML errors included) is the same problem
        if not os.path.exists(path):
            found = f"{path} does not exist"
        else:
            found = f"{path} is not a usable kubeconfig ({str(exc).strip().splitlines()[0] if str(exc) else exc!r})"
    kubeconfig = f"KUBECONFIG={raw}" if raw else "KUBECONFIG (unset)"
    return ("no Kubernetes cluster configured: looked for the in-cluster service account (KUBERNETES_SERVICE_HOST "
            f"and {SERVICE_ACCOUNT_TOKEN}), {kubeconfig} and {home}: {found}; point it at a cluster with "
            "KUBECONFIG=/path/to/kubeconfig (e.g. `kind create cluster` writes ~/.kube/config) or run it in the "
            "cluster (helm install)")


def _retry_after(exc: BaseException) -> float | None:
    """Seconds a 429 (or 503) answer asks the client to wait (its Retry-After header), if it says."""
    headers = getattr(exc, "headers", None) or {}
    try:
        return float(headers.get("Retry-After")) if headers.get("Retry-After") is not None else None
    except (TypeError, ValueError):
        return None


class Budget:
    """A token bucket: at most `qps` requests a second on average, `burst` at once (client-go's rate limiter).
    A burst of thousands of pod creations then reaches the apiserver at a rate it serves instead of all at once
    (which its max-in-flight limit would answer with 429s)."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.qps, self.burst, self._clock = qps, burst, clock
        self._tokens, self._at = float(burst), clock()
        self.reserve = burst // 4  # tokens bulk work leaves to the passes (`bulk`)
        self._bulk_lock: asyncio.Lock | None = None  # made in the loop that first waits on it

    def delay(self) -> float:
        """Take a token; the seconds to wait before using it (0: now). A caller told to wait holds its token
        meanwhile: the next caller waits behind it (the bucket goes negative), so the average stays at `qps`."""
        if self.qps <= 0:
            return 0.0
        self._refill()
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
        self._at = now

    async def bulk(self) -> None:
        """Take a token for work that can wait (a gang's creations: k8s/passes/creations.py), once one is free beyond
        the `reserve` kept for the reconcile passes' own requests. Bulk callers go one after another and never push the
        bucket below that reserve, so a pass's status write is never queued behind thousands of pod creations (in
        the 1000-job run those waits were the reconcile p99: 11.8 s); passes take tokens first, as `delay` says,
        and bulk work waits until the bucket refills. The average stays at `qps` for both together."""
        if self.qps <= 0:
            return
        if self._bulk_lock is None:
            self._bulk_lock = asyncio.Lock()
        async with self._bulk_lock:
            while True:
                self._refill()
                if self._tokens >= 1.0 + self.reserve:
                    self._tokens -= 1.0
                    return
                await asyncio.sleep((1.0 + self.reserve - self._tokens) / self.qps)


def transient(exc: BaseException) -> bool:
    """A failure worth asking again: a busy or briefly unreachable apiserver (5xx, 429, no answer)."""
    if isinstance(exc, ApiException):
        return exc.status in (0, 429) or exc.status >= 500
    return isinstance(exc, Urllib3Error | ConnectionError | TimeoutError)


def _send(fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """One call and its body, read in the worker thread. Reading the body is what hands the connection back to the
    pool: read on the event loop after the thread returned, it held the connection until the busy loop got to it
    while the thread took another, so under a burst more calls held connections than the pool keeps ("Connection
    pool is full, discarding connection"), and the loop waited on sockets."""
    resp = fn(*args, **kw)
    return resp.data if hasattr(resp, "data") else resp


def _plural(kind: str) -> str:
    return {"NetworkPolicy": "networkpolicies", "PodDisruptionBudget": "poddisruptionbudgets"}.get(kind,
                                                                                                 kind.lower() + "s")


class Kube:
    """`workers`: API calls in flight at once. Each waits in a thread of its own pool with a connection of its own:
    asyncio's default executor has min(32, cores + 4) threads (6 on a 2-core pod) and urllib3 keeps cores * 5
    connections, so a thousand jobs' calls would queue there (and churn connections) rather than at the API."""

    def __init__(self, api: client.ApiClient, *, retries: int = 6, timeout: float = 15.0, backoff: float = 0.2,
                 workers: int = 40, qps: float = 100.0, burst: int = 200):
        # one connection per worker, and those of the three watches (k8s/cache/mirror.py: the operator's pods, the
        # nodes, other tenants' pods) and a spare: a pool one short discards a connection per call (1339 "Connection
        # pool is full" in a 300-job run; with two watches more than it counted, still thousands at 1000 jobs)
        if (api.configuration.connection_pool_maxsize or 0) < workers + 4:
            api.configuration.connection_pool_maxsize = workers + 4
            api.rest_client.pool_manager.clear()
            api.rest_client = rest.RESTClientObject(api.configuration)
        self.api = api
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kube-api")
        # Bulk calls leave a fifth of the threads (8 of 40) to the passes: a slow apiserver never leaves a pass's
        # request without one. Under a burst each POST takes about 0.5 s on the 2-core testbed, so the calls in
        # flight set the creation rate: with half of 32 threads the 1000-job run created its pods half as fast.
        self._bulk_slots = asyncio.Semaphore(max(1, workers - max(1, workers // 5)))
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.ext = client.ApiextensionsV1Api(api)
        self.retries, self.timeout, self.backoff = retries, timeout, backoff
        self.budget = Budget(qps, burst)
        self.requests = 0  # sent, retries included (a figure for the benchmark and the tests)
        self._served: dict[str, tuple[float, list[str]]] = {}  # CRD name -> (read at, served versions)

    async def _call(self, fn: Callable[..., Any], *args: Any, bulk: bool = False, **kw: Any) -> Any:
        """Run one API call in a thread; retry transient failures; decode the JSON body. `bulk`: work that can
        wait for the passes' requests (Budget.bulk)."""
        kw.setdefault("_request_timeout", self.timeout)
        kw.setdefault("_preload_content", False)
        delay = self.backoff
        unsure = False  # an earlier attempt's request may have been applied (see Conflict.unsure)
        for attempt in range(self.retries + 1):
            if bulk:
                await self.budget.bulk()
            elif (wait := self.budget.delay()) > 0:
                await asyncio.sleep(wait)
            self.requests += 1
            try:
                async with self._bulk_slots if bulk else contextlib.nullcontext():
                    data = await asyncio.get_running_loop().run_in_executor(self._pool,
                                                                            functools.partial(_send, fn, args, kw))
                return json.loads(data) if data else None
            except Exception as exc:  # noqa: BLE001 - classified below
                if isinstance(exc, ApiException) and unsure:
                    exc.seqtrain_unsure = True  # type: ignore[attr-defined]
                if transient(exc) and not (isinstance(exc, ApiException) and exc.status == 429):
                    unsure = True  # a 429 was refused before anything ran; a timeout or a 5xx may have run
                if not transient(exc) or attempt == self.retries:
                    if transient(exc):
                        raise Unavailable(f"{getattr(fn, '__name__', fn)}: {exc}") from exc
                    raise
                log.debug("retrying %s after %s", getattr(fn, "__name__", fn), exc)
                # the server's own Retry-After (429: too many requests in flight) over our guess
                await asyncio.sleep(min(30.0, _retry_after(exc) or delay))
                delay = min(delay * 2, 3.0)
        raise AssertionError("unreachable")

    async def priority_value(self, name: str) -> int | None:
        """The value of PriorityClass `name` (None: no such class, or not readable)."""
        try:
            pc = await self._call(client.SchedulingV1Api(self.api).read_priority_class, name)
        except ApiException as exc:
            if exc.status in (403, 404):
                return None
            raise
        return int((pc or {}).get("value") or 0)

    # ---- the job ---------------------------------------------------------------------------------------------

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call(self.custom.get_namespaced_custom_object, API_GROUP, _VERSION, namespace,
                                    PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def write_status(self, namespace: str, name: str, status: dict[str, Any], resource_version: str
                           ) -> dict[str, Any]:
        """Merge-patch .status with an optimistic lock on resourceVersion (raises Conflict)."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        try:
            return await self._call(self.custom.patch_namespaced_custom_object_status, API_GROUP, _VERSION,
                                    namespace, PLURAL, name, body)
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(str(exc.reason), unsure=getattr(exc, "seqtrain_unsure", False)) from exc
            raise

    # ---- reads -----------------------------------------------------------------------------------------------

    async def list_pods(self, namespace: str | None, label_selector: str = "", field_selector: str = "") -> list[dict]:
        return (await self.list_pods_paged(namespace, label_selector, field_selector))[0]

    async def list_pods_paged(self, namespace: str | None, label_selector: str = "", field_selector: str = "",
                              project: Callable[[dict], dict] | None = None) -> tuple[list[dict], str]:
        """Every selected pod, `PAGE` at a time (one response never holds the whole cluster, in the apiserver's
        memory or in ours: `project` trims each page as it arrives), and the list's resourceVersion (where a
        watch continues from). A continue token that expired (410) starts the LIST over."""
        if namespace:
            return await self._paged(project, self.core.list_namespaced_pod, namespace,
                                     label_selector=label_selector, field_selector=field_selector)
        return await self._paged(project, self.core.list_pod_for_all_namespaces,
                                 label_selector=label_selector, field_selector=field_selector)

    async def _paged(self, project: Callable[[dict], dict] | None, call: Callable[..., Any], *args: Any,
                     **selectors: str) -> tuple[list[dict], str]:
        """One LIST `PAGE` at a time, each page trimmed by `project` as it arrives; a continue token that expired
        (410) starts the LIST over. Returns the items and the list's resourceVersion."""
        items: list[dict] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {**selectors, "limit": PAGE}
            if token:
                kw["_continue"] = token
            try:
                data = await self._call(call, *args, **kw)
            except ApiException as exc:
                if exc.status == 410 and token:
                    items, token = [], None
                    continue
                raise
            page = data.get("items") or []
            items.extend(map(project, page) if project is not None else page)
            meta = data.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    async def list_nodes(self) -> list[dict]:
        return (await self._call(self.core.list_node)).get("items", [])

    async def list_nodes_paged(self, label_selector: str = "", project: Callable[[dict], dict] | None = None
                               ) -> tuple[list[dict], str]:
        """Every selected node, `PAGE` at a time, and the list's resourceVersion (see list_pods_paged)."""
        return await self._paged(project, self.core.list_node, label_selector=label_selector)

    async def crd_exists(self, name: str) -> bool:
        return await self.get_crd(name) is not None

    async def get_crd(self, name: str) -> dict[str, Any] | None:
        try:
            return await self._call(self.ext.read_custom_resource_definition, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def served_versions(self, crd: str, max_age: float = 600.0) -> list[str]:
        """The versions a CustomResourceDefinition serves now ([] when it is not installed), read at most once per
        `max_age` seconds: another controller's upgrade (e.g. Kueue switching a version off) is seen within that."""
        now = time.monotonic()
        cached = self._served.get(crd)
        if cached is not None and now - cached[0] < max_age:
            return cached[1]
        obj = await self.get_crd(crd)
        versions = [v["name"] for v in ((obj or {}).get("spec") or {}).get("versions") or [] if v.get("served")]
        if cached is None or cached[1] != versions:
            log.info("CRD %s serves %s", crd, ", ".join(versions) or "no version (not installed)")
        self._served[crd] = (now, versions)
        return versions

    # ---- writes ----------------------------------------------------------------------------------------------

    async def create(self, obj: dict[str, Any], bulk: bool = False) -> bool:
        """Create a namespaced object; False when it already exists and is the same job's (idempotent). Raises
        NameTaken when the existing one is another job's: a predecessor's pod or immutable ConfigMap is never
        taken for this job's own. `bulk`: see `_call`."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        kind, api_version = obj["kind"], obj["apiVersion"]
        try:
            if api_version == "v1":
                fn = {"Pod": self.core.create_namespaced_pod, "Service": self.core.create_namespaced_service,
                      "ConfigMap": self.core.create_namespaced_config_map,
                      "Secret": self.core.create_namespaced_secret}[kind]
                await self._call(fn, ns, obj, bulk=bulk)
            else:
                group, version = api_version.split("/")
                await self._call(self.custom.create_namespaced_custom_object, group, version, ns, _plural(kind), obj,
                                 bulk=bulk)
            return True
        except ApiException as exc:
            if exc.status != 409:
                raise
        if kind == "Secret":  # the operator may create Secrets, never read them; its own are named by job uid
            return False
        mine = owner_uid(obj)
        there = await self.read(api_version, kind, ns, name)
        theirs = owner_uid(there) if there is not None else None
        if there is None or (mine is not None and theirs is not None and theirs != mine):
            meta = (there or {}).get("metadata") or {}
            raise NameTaken(obj, meta.get("uid"), bool(meta.get("deletionTimestamp")), theirs)
        return False

    async def read(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One namespaced object (None: absent)."""
        try:
            if api_version == "v1":
                fn = {"Pod": self.core.read_namespaced_pod, "Service": self.core.read_namespaced_service,
                      "ConfigMap": self.core.read_namespaced_config_map,
                      "PersistentVolumeClaim": self.core.read_namespaced_persistent_volume_claim}[kind]
                return await self._call(fn, name, namespace)
            group, version = api_version.split("/")
            return await self._call(self.custom.get_namespaced_custom_object, group, version, namespace,
                                    _plural(kind), name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def delete_exact(self, api_version: str, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete this very object (a precondition on its uid: never a namesake created meanwhile)."""
        body = {"preconditions": {"uid": uid}}
        try:
            if api_version == "v1":
                fn = {"Pod": self.core.delete_namespaced_pod, "Service": self.core.delete_namespaced_service,
                      "ConfigMap": self.core.delete_namespaced_config_map}[kind]
                await self._call(fn, name, namespace, body=body)
            else:
                group, version = api_version.split("/")
                await self._call(self.custom.delete_namespaced_custom_object, group, version, namespace,
                                 _plural(kind), name, body=body)
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or another object by now (the precondition failed)
                raise

    async def delete_pods(self, namespace: str, label_selector: str, *, node: str | None = None,
                          force: bool = False) -> None:
        """Delete the selected pods (gracefully, or at once with `force`: gracePeriodSeconds 0, for pods whose
        node is gone and whose kubelet will never confirm). `node` narrows it to the pods bound to that node."""
        kw: dict[str, Any] = {"label_selector": label_selector}
        if node is not None:
            kw["field_selector"] = f"spec.nodeName={node}"
        if force:
            kw["grace_period_seconds"] = 0
        await self._call(self.core.delete_collection_namespaced_pod, namespace, **kw)

    async def delete_configmaps(self, namespace: str, label_selector: str) -> None:
        await self._call(self.core.delete_collection_namespaced_config_map, namespace, label_selector=label_selector)

    async def delete_custom(self, api_version: str, plural: str, namespace: str, name: str) -> None:
        group, version = api_version.split("/")
        try:
            await self._call(self.custom.delete_namespaced_custom_object, group, version, namespace, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
