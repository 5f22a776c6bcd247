"""kopf's own admission engine (what its WebhookServer calls with a parsed AdmissionReview) with the operator's
validating handler registered, for tests that answer review bodies without a server or a cluster."""

from __future__ import annotations

import functools
import json
from typing import Any

import kopf
from kopf._cogs.structs import ephemera, references
from kopf._core.engines import admission, indexing
from kopf._core.intents import registries
from kopf._core.reactor import inventory

from seqtrain_operator.k8s.process import handlers
from seqtrain_operator.k8s.webhook import review

GROUP, VERSION, PLURAL = "seqtrain.dev", "v1alpha1", "seqtrainjobs"


def engine() -> Any:
    registry = registries.OperatorRegistry()
    kopf.on.validate(GROUP, VERSION, PLURAL, id=handlers.WEBHOOK_ID, operations=["CREATE", "UPDATE"],
                     registry=registry)(handlers.admit)
    insights = references.Insights()
    insights.webhook_resources.add(references.Resource(GROUP, VERSION, PLURAL, namespaced=True))
    return functools.partial(admission.serve_admission_request, settings=kopf.OperatorSettings(), registry=registry,
                             insights=insights, memories=inventory.ResourceMemories(),
                             memobase=ephemera.AnyMemo(ephemera.Memo()), indices=indexing.OperatorIndexers().indices)


def review_of(obj: Any, operation: str = "CREATE", old: Any = None, uid: str = "req-1") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "operation": operation, "userInfo": {"username": "tenant"},
        "resource": {"group": GROUP, "version": VERSION, "resource": PLURAL},
        "kind": {"group": GROUP, "version": VERSION, "kind": "SeqTrainJob"},
        "object": obj, "oldObject": old}}


async def answer(raw: bytes | dict[str, Any], fn: Any = None) -> dict[str, Any]:
    """The AdmissionReview the webhook answers to `raw` (a body, or a review to encode)."""
    body = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    return await review.review(body, fn or engine(), webhook=handlers.WEBHOOK_ID, sslpeer={}, headers={})
