"""The few Kubernetes API calls the operator makes, with retries, returning plain dicts.

The official (synchronous) client runs in worker threads. Transient failures (HTTP 5xx, 429, timeouts, dropped
connections) are retried with capped exponential backoff; 409 AlreadyExists on create counts as success (the
object is there: idempotent); 404 on delete likewise. A 409 Conflict on the status write is raised as `Conflict`
so the caller re-reads and decides again instead of overwriting a newer object.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client, config
from kubernetes.client import rest
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from seqtrain.spec import API_GROUP, API_VERSION, PLURAL

log = logging.getLogger("seqtrain.operator")
_VERSION = API_VERSION.split("/")[1]


class Conflict(Exception):
    """The object changed since it was read (HTTP 409 on a write with a resourceVersion precondition)."""


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


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in (0, 429) or exc.status >= 500
    return isinstance(exc, Urllib3Error | ConnectionError | TimeoutError)


class Kube:
    """`workers`: API calls in flight at once. Each waits in a thread of its own pool with a connection of its own:
    asyncio's default executor has min(32, cores + 4) threads (6 on a 2-core pod) and urllib3 keeps cores * 5
    connections, so a thousand jobs' calls would queue there (and churn connections) rather than at the API."""

    def __init__(self, api: client.ApiClient, *, retries: int = 6, timeout: float = 15.0, backoff: float = 0.2,
                 workers: int = 32):
        if (api.configuration.connection_pool_maxsize or 0) < workers:
            api.configuration.connection_pool_maxsize = workers
            api.rest_client.pool_manager.clear()
            api.rest_client = rest.RESTClientObject(api.configuration)
        self.api = api
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kube-api")
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.ext = client.ApiextensionsV1Api(api)
        self.retries, self.timeout, self.backoff = retries, timeout, backoff

    async def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run one API call in a thread; retry transient failures; decode the JSON body."""
        kw.setdefault("_request_timeout", self.timeout)
        kw.setdefault("_preload_content", False)
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                resp = await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kw))
                data = resp.data if hasattr(resp, "data") else resp
                return json.loads(data) if data else None
            except Exception as exc:  # noqa: BLE001 - classified below
                if not _transient(exc) or attempt == self.retries:
                    if _transient(exc):
                        raise Unavailable(f"{getattr(fn, '__name__', fn)}: {exc}") from exc
                    raise
                log.debug("retrying %s after %s", getattr(fn, "__name__", fn), exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 3.0)
        raise AssertionError("unreachable")

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
                raise Conflict(str(exc.reason)) from exc
            raise

    # ---- reads -----------------------------------------------------------------------------------------------

    async def list_pods(self, namespace: str | None, label_selector: str = "", field_selector: str = "") -> list[dict]:
        if namespace:
            data = await self._call(self.core.list_namespaced_pod, namespace, label_selector=label_selector,
                                    field_selector=field_selector)
        else:
            data = await self._call(self.core.list_pod_for_all_namespaces, label_selector=label_selector,
                                    field_selector=field_selector)
        return data.get("items", [])

    async def list_nodes(self) -> list[dict]:
        return (await self._call(self.core.list_node)).get("items", [])

    async def crd_exists(self, name: str) -> bool:
        return await self.get_crd(name) is not None

    async def get_crd(self, name: str) -> dict[str, Any] | None:
        try:
            return await self._call(self.ext.read_custom_resource_definition, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # ---- writes ----------------------------------------------------------------------------------------------

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create a namespaced object; False when it already exists (idempotent)."""
        ns = obj["metadata"]["namespace"]
        kind, api_version = obj["kind"], obj["apiVersion"]
        try:
            if api_version == "v1":
                fn = {"Pod": self.core.create_namespaced_pod, "Service": self.core.create_namespaced_service,
                      "ConfigMap": self.core.create_namespaced_config_map}[kind]
                await self._call(fn, ns, obj)
            else:
                group, version = api_version.split("/")
                plural = "networkpolicies" if kind == "NetworkPolicy" else kind.lower() + "s"
                await self._call(self.custom.create_namespaced_custom_object, group, version, ns, plural, obj)
            return True
        except ApiException as exc:
            if exc.status == 409:
                return False
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
