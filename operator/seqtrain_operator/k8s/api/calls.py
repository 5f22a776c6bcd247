"""API calls beyond `client.Kube`'s core set, used by TTL and the gang scheduler adapters (same retries: they go
through `Kube._call`). Deletes treat 404 as done; patches of a vanished object too."""

from __future__ import annotations

from typing import Any

from kubernetes.client.rest import ApiException

from seqtrain.spec import API_GROUP, API_VERSION, PLURAL
from seqtrain_operator.k8s.api.client import Kube
from seqtrain_operator.k8s.api.patches import remove_finalizer_ops

_VERSION = API_VERSION.split("/")[1]


async def _ignore_404(coro: Any) -> Any:
    try:
        return await coro
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None


async def delete_job(kube: Kube, namespace: str, name: str) -> None:
    """Delete the SeqTrainJob; Background propagation: the garbage collector removes what it owns, and the
    operator's finalizer stops running pods gracefully first."""
    await _ignore_404(kube._call(kube.custom.delete_namespaced_custom_object, API_GROUP, _VERSION, namespace, PLURAL,
                                 name, propagation_policy="Background"))


async def patch_pod(kube: Kube, namespace: str, name: str, patch: dict[str, Any]) -> None:
    """A JSON merge patch of one pod."""
    await _ignore_404(kube._call(kube.core.patch_namespaced_pod, namespace, name, patch))


async def remove_finalizer(kube: Kube, pod: dict[str, Any], finalizer: str) -> bool:
    """Drop one finalizer from a pod with a JSON patch guarded by a test of the list (so a concurrent change of the
    finalizers makes the patch fail instead of dropping someone else's). True when it was removed."""
    meta = pod["metadata"]
    if (ops := remove_finalizer_ops(meta, finalizer)) is None:
        return False
    try:
        await kube._call(kube.core.patch_namespaced_pod, meta["namespace"], meta["name"], ops,
                         _content_type="application/json-patch+json")
    except ApiException as exc:
        if exc.status in (404, 409, 422):  # gone, or the list changed under us: the next pass looks again
            return False
        raise
    return True


async def list_custom(kube: Kube, api_version: str, plural: str, namespace: str,
                      label_selector: str = "") -> list[dict[str, Any]]:
    group, version = api_version.split("/")
    data = await _ignore_404(kube._call(kube.custom.list_namespaced_custom_object, group, version, namespace, plural,
                                        label_selector=label_selector))
    return (data or {}).get("items", [])


async def delete_custom(kube: Kube, api_version: str, plural: str, namespace: str, name: str) -> None:
    group, version = api_version.split("/")
    await _ignore_404(kube._call(kube.custom.delete_namespaced_custom_object, group, version, namespace, plural, name))


async def patch_custom(kube: Kube, api_version: str, plural: str, namespace: str, name: str,
                       patch: dict[str, Any]) -> bool:
    """A JSON merge patch of one namespaced custom object; False when it does not exist (left alone)."""
    group, version = api_version.split("/")
    return await _ignore_404(kube._call(kube.custom.patch_namespaced_custom_object, group, version, namespace, plural,
                                        name, patch)) is not None
