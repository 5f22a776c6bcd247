"""The admission webhook's HTTP side: bounds on an AdmissionReview before it is parsed, and an answer for every body.

kopf's WebhookServer reads the whole body, `json.loads` it and hands it to kopf's admission engine, which diffs the
old and new objects before any handler runs. All of these recurse: a review nested 5000 deep raised RecursionError
(a 500 and a traceback per request), a 5001-digit number a ValueError (Python's int-string limit). Here the raw
body is refused first, each with one line and an AdmissionReview that says allowed: false (the API server shows the
message to the user), when it is
- larger than MAX_REVIEW_BYTES (1 MiB: a spec may be 256 KiB, seqtrain.spec.bounds, and an UPDATE carries two
  objects and their managedFields), or
- nested deeper than MAX_REVIEW_DEPTH (the spec's 32 levels, plus the review's envelope and managedFields), or
- not a JSON object (or a number Python cannot read).
The spec inside is then held to seqtrain.spec.bounds by the handler's parse_job, with the field named.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp.web
import kopf
from kopf._core.engines.admission import WebhookError

from seqtrain.spec.bounds import MAX_DEPTH, bracket_depth

log = logging.getLogger("seqtrain.operator")
MAX_REVIEW_BYTES = 1024 * 1024
# review -> request -> object -> spec ...; managedFields[].fieldsV1 mirror the object a few levels further down
MAX_REVIEW_DEPTH = MAX_DEPTH + 8
_UID = re.compile(rb'"request"\s*:\s*\{[^{}]*?"uid"\s*:\s*"([0-9A-Za-z-]{1,64})"')
ReviewFn = Callable[..., Awaitable[dict[str, Any]]]


def refusal(raw: bytes | None, code: int, message: str, data: Any = None) -> dict[str, Any]:
    """An AdmissionReview (admission.k8s.io/v1) that refuses with `message`. The request's uid is read from the
    parsed review if there is one, else from the raw body (the API server checks it matches its request)."""
    uid = ""
    request = data.get("request") if isinstance(data, dict) else None
    if isinstance(request, dict) and isinstance(request.get("uid"), str):
        uid = request["uid"]
    elif raw is not None and (m := _UID.search(raw[:4096])):
        uid = m.group(1).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": {"uid": uid, "allowed": False, "status": {"code": code, "message": message}}}


def review_problem(raw: bytes) -> tuple[int, str] | None:
    """(HTTP-like code, one line) for a raw review refused before parsing, or None."""
    if len(raw) > MAX_REVIEW_BYTES:
        return 413, (f"the SeqTrainJob is too large: the admission review is more than {MAX_REVIEW_BYTES // 1024} "
                     "KiB (a spec may be at most 256 KiB): move data into a ConfigMap, a Secret or a volume")
    if bracket_depth(raw, MAX_REVIEW_DEPTH) > MAX_REVIEW_DEPTH:
        return 422, (f"the SeqTrainJob is nested more than {MAX_DEPTH} levels deep; no SeqTrainJob field is: "
                     "flatten it")
    return None


async def review(raw: bytes, fn: ReviewFn, **kwargs: Any) -> dict[str, Any]:
    """The answer to one raw AdmissionReview body: `fn` (kopf's admission engine) with the parsed review, unless
    the body is refused first. Never raises for a bad body: the answer refuses it with one line."""
    if (problem := review_problem(raw)) is not None:
        return refusal(raw, *problem)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int-string limit
        why = ("a number of more than 4300 digits; Kubernetes stores at most 64-bit integers"
               if "digits" in str(exc) else str(exc)[:200])
        return refusal(raw, 400, f"the admission review cannot be read: {why}")
    if not isinstance(data, dict) or not isinstance(data.get("request"), dict):
        return refusal(raw, 400, "the body is not an AdmissionReview (no request object)", data)
    try:
        return await fn(data, **kwargs)
    except WebhookError as exc:  # kopf's envelope errors: no userInfo, no object, a resource not served here
        return refusal(raw, 400, f"malformed AdmissionReview ({str(exc)[:200]})", data)
    except (KeyError, TypeError, AttributeError, ValueError, RecursionError) as exc:
        # kopf's engine reads the envelope (request.resource, userInfo, object) without checking its shape
        return refusal(raw, 400, f"malformed AdmissionReview ({type(exc).__name__}: {str(exc)[:200]})", data)
    except kopf.AdmissionError as exc:
        return refusal(raw, exc.code or 422, str(exc), data)


async def read_body(request: aiohttp.web.Request, limit: int = MAX_REVIEW_BYTES) -> bytes:
    """The body, or its first limit + 1 bytes (enough to refuse it): never more in memory."""
    chunks, size = [], 0
    while size <= limit:
        chunk = await request.content.readany()
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)[:limit + 1]


class BoundedWebhookServer(kopf.WebhookServer):
    """kopf's WebhookServer, with every request answered by `review`."""

    @staticmethod
    async def _serve(fn: ReviewFn, request: aiohttp.web.Request) -> aiohttp.web.Response:
        headers = dict(request.headers)
        sslpeer = request.transport.get_extra_info("peercert") if request.transport else None
        try:
            raw = await read_body(request)
        except ConnectionResetError as exc:  # the API server gave up mid-body (its timeout): no one to answer
            log.info("admission review abandoned by the client while its body was read: %s", str(exc)[:200])
            return aiohttp.web.Response(status=400, text="connection lost while reading the review\n")
        answer = await review(raw, fn, webhook=request.match_info.get("id"), sslpeer=sslpeer, headers=headers)
        response = answer.get("response") or {}
        if not response.get("allowed", True):
            log.info("admission refused: %s", str((response.get("status") or {}).get("message", ""))[:300])
        return aiohttp.web.json_response(answer)
