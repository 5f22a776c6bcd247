"""The webhook's bounds (seqtrain_operator/k8s/webhook/review.py, seqtrain/spec/bounds.py): a review too large, too
deep, with an unreadable number or not a review at all is refused with one line in an AdmissionReview, never a 500; a
job whose pods cannot be built fails once, naming why, instead of raising on every pass."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest
from test_admission_lock import Index, Kube
from webhook_engine import answer, review_of

from jobs import make_job
from seqtrain.spec.bounds import MAX_DEPTH, MAX_SPEC_BYTES, bracket_depth
from seqtrain_operator.k8s.passes import reconcile
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.settings import Settings
from seqtrain_operator.k8s.webhook.review import MAX_REVIEW_BYTES

GOOD = make_job("j", "ml", metadata={"uid": "uid-j", "resourceVersion": "1", "generation": 1},
                replicas=1, resources={"cpu": "1", "memory": "1Gi"},
                training={"steps": 10, "globalBatchSize": 4, "microBatchSize": 4})


def job(**template: Any) -> dict[str, Any]:
    doc = copy.deepcopy(GOOD)
    doc["spec"]["podTemplate"] = {"spec": template}
    return doc


def nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {}
    top = node
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return top


def refused(review: dict[str, Any]) -> tuple[int, str]:
    response = review["response"]
    assert response["allowed"] is False and response["uid"] == "req-1", response
    message = response["status"]["message"]
    assert message and "\n" not in message and "Traceback" not in message
    return response["status"]["code"], message


def run(raw: bytes | dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(answer(raw))


def test_a_valid_job_is_admitted() -> None:
    assert run(review_of(GOOD))["response"] == {"uid": "req-1", "allowed": True}


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 250, 980, 5000])
def test_nesting_beyond_the_bound_is_refused_before_parsing(depth: int) -> None:
    doc = job(affinity={"podAffinity": {"x": nested(5)}})
    raw = json.dumps(review_of(doc)).encode()
    raw = raw.replace(b'{"a": {"a": {"a": {"a": {"a": {}}}}}}', b'{"a": ' * depth + b"{}" + b"}" * depth)
    code, message = refused(run(raw))
    assert code == 422 and f"more than {MAX_DEPTH} levels" in message


def test_a_document_just_deeper_than_the_spec_allows_names_the_field() -> None:
    doc = job(affinity={"podAffinity": nested(MAX_DEPTH - 3)})
    code, message = refused(run(review_of(doc)))
    assert code == 422 and message.startswith("spec.podTemplate.spec.affinity.podAffinity.a.a") and \
        f"more than {MAX_DEPTH} levels" in message


def test_a_spec_over_the_size_bound_is_refused() -> None:
    big = job(containers=[{"name": "s", "image": "x", "env": [{"name": "V", "value": "x" * (MAX_SPEC_BYTES + 10)}]}])
    code, message = refused(run(review_of(big)))
    assert code == 422 and "KiB" in message
    huge = job(containers=[{"name": "s", "image": "x", "env": [{"name": "V", "value": "x" * MAX_REVIEW_BYTES}]}])
    code, message = refused(run(review_of(huge)))
    assert code == 413 and "too large" in message


def test_a_number_python_cannot_read_is_refused_in_one_line() -> None:
    raw = json.dumps(review_of(GOOD)).encode().replace(b'"steps": 10', b'"steps": ' + b"9" * 5001)
    code, message = refused(run(raw))
    assert code == 400 and "4300 digits" in message
    raw = json.dumps(review_of(GOOD)).encode().replace(b'"steps": 10', b'"steps": ' + b"9" * 4000)
    code, message = refused(run(raw))
    assert code == 422 and "spec.training.steps" in message


@pytest.mark.parametrize("raw", [b"", b"not json", b"[]", b'{"request": 1}', b'{"request": {"uid": "req-1"}}',
                                 json.dumps(review_of(GOOD)).encode().replace(b'"userInfo"', b'"nobody"'),
                                 json.dumps(review_of(GOOD)).encode()[:-7]])
def test_a_body_that_is_not_a_review_is_refused_with_a_message(raw: bytes) -> None:
    review = run(raw)
    assert review["response"]["allowed"] is False and review["response"]["status"]["message"], review
    assert review["response"]["status"]["code"] == 400


def test_depth_is_counted_without_parsing_and_strings_do_not_count() -> None:
    assert bracket_depth(b'{"a": [1, {"b": "[[[[{{{{"}], "c": "\\"[["}', 100) == 3
    assert bracket_depth(b"a: ['[[[', '''']\n", 100) == 1  # YAML's single quotes too
    assert bracket_depth(b"[" * 10_000, 40) == 41  # stops counting past the limit


def _reconcile(body: dict[str, Any]) -> tuple[Kube, reconcile.Outcome]:
    kube = Kube(body)
    r = reconcile.Reconciler(kube, Settings(pods=m.Settings(), poll_progress=False))  # type: ignore[arg-type]
    outcome = asyncio.run(r.reconcile("ml", body["metadata"]["name"], lambda *a: None, Index()))
    return kube, outcome


def _failed(outcome: reconcile.Outcome) -> str:
    assert outcome.status is not None and outcome.status.phase == "Failed" and outcome.requeue is None
    failed = next(c for c in outcome.status.conditions if c.type == "Failed")
    assert failed.reason == "InvalidSpec"
    return failed.message


def test_an_affinity_the_merge_cannot_read_fails_the_job_naming_the_field() -> None:
    """It passed validation and raised AttributeError in the pod builder on every reconcile pass."""
    body = job(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": "x"}})
    kube, outcome = _reconcile(body)
    assert kube.created == []
    assert "spec.podTemplate.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution" in \
        _failed(outcome)


def test_a_job_whose_pods_cannot_be_built_fails_once_instead_of_raising_every_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Any builder error a rule does not catch yet: one Failed condition with the error, no object created."""
    def broken(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise KeyError("name")

    monkeypatch.setattr(m, "build_pod", broken)
    kube, outcome = _reconcile(job())
    assert kube.created == []
    assert "cannot be built" in _failed(outcome) and "KeyError" in _failed(outcome)


def test_the_server_reads_at_most_the_bound_and_answers_with_a_review() -> None:
    """BoundedWebhookServer._serve on a real aiohttp server: a body over the bound is answered (refused) after
    reading MAX_REVIEW_BYTES + 1 bytes; a valid review reaches kopf's engine."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    from webhook_engine import engine

    from seqtrain_operator.k8s.webhook.review import BoundedWebhookServer

    fn = engine()

    async def serve(request: web.Request) -> web.Response:
        return await BoundedWebhookServer._serve(fn, request)

    async def go() -> list[tuple[int, dict[str, Any]]]:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([web.post("/{id:.*}", serve)])
        out = []
        async with TestClient(TestServer(app)) as client:
            for body in (json.dumps(review_of(GOOD)).encode(), b'{"request": {"uid": "req-1", "x": "' +
                         b"x" * (3 * MAX_REVIEW_BYTES) + b'"}}'):
                r = await client.post("/validate-seqtrainjob", data=body)
                out.append((r.status, await r.json()))
        return out

    (ok_status, ok), (big_status, big) = asyncio.run(go())
    assert ok_status == 200 and ok["response"]["allowed"] is True
    assert big_status == 200 and big["response"]["uid"] == "req-1" and big["response"]["status"]["code"] == 413


def test_a_client_that_hangs_up_mid_body_gets_no_traceback(caplog) -> None:
    """The chaos soak's seed 20261128 (an API server timing out on a slowed webhook): aiohttp's readany raised
    ConnectionResetError out of the handler and into the operator's log as a traceback."""
    from types import SimpleNamespace

    from seqtrain_operator.k8s.webhook.review import BoundedWebhookServer

    async def readany() -> bytes:
        raise ConnectionResetError("Connection lost")

    request = SimpleNamespace(headers={}, transport=None, match_info={}, content=SimpleNamespace(readany=readany))
    with caplog.at_level("INFO", logger="seqtrain.operator"):
        answer = asyncio.run(BoundedWebhookServer._serve(lambda *a, **k: None, request))  # type: ignore[arg-type]
    assert answer.status == 400
    assert any("abandoned by the client" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("depth", [33, 250, 300])  # the fake API client's deepcopy itself recurses past ~450
def test_a_stored_job_nested_too_deep_fails_once_naming_the_field(depth: int) -> None:
    """Stored by an operator without these bounds (or with the webhook off): a pass went on with it."""
    kube, outcome = _reconcile(job(affinity={"podAffinity": {"x": nested(depth)}}))
    assert kube.created == []
    assert "spec.podTemplate.spec.affinity.podAffinity.x.a" in _failed(outcome)
