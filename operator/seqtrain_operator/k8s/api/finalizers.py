"""`seqtrain operator --release-finalizers`: what `helm uninstall` runs once the operator is gone (the chart's
post-delete hook), so no SeqTrainJob is left with a finalizer that nothing will ever remove.

The jobs themselves stay (uninstalling the operator must not delete anyone's training); they, and through their
ownerReferences their pods, can be deleted as usual afterwards, and an operator installed again adds its finalizer
back when it next handles them. Each removal is a JSON patch guarded by a test of the finalizer list, so a
concurrent change makes it fail (and be retried on fresh data) instead of dropping someone else's finalizer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from seqtrain.spec import API_GROUP, API_VERSION, PLURAL
from seqtrain_operator.k8s.api.patches import remove_finalizer_ops

FINALIZER = f"{API_GROUP}/cleanup"  # the operator's (kopf's settings.persistence.finalizer, k8s/process/handlers.py)
_VERSION = API_VERSION.split("/")[1]


def _api(service_account_dir: str | None) -> Any:
    from kubernetes import client
    from kubernetes.config.incluster_config import InClusterConfigLoader

    from seqtrain_operator.k8s.api.client import load_config

    token = os.path.join(service_account_dir, "token") if service_account_dir else ""
    if token and os.path.exists(token):
        InClusterConfigLoader(token_filename=token,
                              cert_filename=os.path.join(service_account_dir or "", "ca.crt")).load_and_set()
        return client.CustomObjectsApi()
    return client.CustomObjectsApi(load_config())


def _jobs(api: Any, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    if not namespaces:
        return api.list_cluster_custom_object(API_GROUP, _VERSION, PLURAL)["items"]
    out: list[dict[str, Any]] = []
    for ns in namespaces:
        out += api.list_namespaced_custom_object(API_GROUP, _VERSION, ns, PLURAL)["items"]
    return out


def release_one(api: Any, job: dict[str, Any], attempts: int = 5) -> bool:
    """Remove the operator's finalizer from one job; True when this call removed it."""
    from kubernetes.client.rest import ApiException

    meta = job["metadata"]
    for _ in range(attempts):
        if (ops := remove_finalizer_ops(meta, FINALIZER)) is None:
            return False
        try:
            api.patch_namespaced_custom_object(API_GROUP, _VERSION, meta["namespace"], PLURAL, meta["name"], ops,
                                               _content_type="application/json-patch+json")
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            if exc.status not in (409, 422):  # 409/422: the list changed under us: read it again
                raise
        meta = api.get_namespaced_custom_object(API_GROUP, _VERSION, meta["namespace"], PLURAL,
                                                meta["name"])["metadata"]
    raise RuntimeError(f"{meta['namespace']}/{meta['name']}: its finalizers kept changing; run again")


def release_finalizers(namespaces: Sequence[str], service_account_dir: str | None = None) -> int:
    """Exit code: 0 when no job in scope keeps the operator's finalizer."""
    api = _api(service_account_dir)
    released = [f"{j['metadata']['namespace']}/{j['metadata']['name']}" for j in _jobs(api, namespaces)
                if release_one(api, j)]
    where = ", ".join(namespaces) if namespaces else "all namespaces"
    print(f"seqtrain: released the finalizer {FINALIZER} of {len(released)} SeqTrainJob(s) in {where}"
          + (f": {', '.join(released)}" if released else ""), file=sys.stderr)
    return 0
