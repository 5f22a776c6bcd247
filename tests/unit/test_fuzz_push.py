"""Fuzzing the servers' request surfaces with generated hostile input: the progress push endpoint's HTTP reader and
its store (k8s/progress/push.py), and the trainer's bounded server (seqtrain.obs.httpserve), which also serves the
operator's /metrics. The invariant: an answer with a 2xx or 4xx status (or, for a request cut short, no answer), never
another exception, a 500 or a hang. Inputs that once broke one of these stay below as explicit examples."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from seqtrain.obs import httpserve
from seqtrain_operator.k8s.pods.pushauth import job_token
from seqtrain_operator.k8s.progress import push

pytestmark = pytest.mark.fuzz
KEY = b"k" * 32
PATH = "/v1/progress/ml/gpt/u1/1"
TOKEN = job_token(KEY, "ml", "gpt", "u1", 1)
ANSWERS = {204, 400, 403, 404, 405, 409, 411, 413, 431}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30)
documents = st.fixed_dictionaries(
    {}, optional={"step": json_values | st.integers(), "totalSteps": json_values, "attempt": json_values,
                  "loss": json_values, "updatedAt": json_values | st.text(max_size=40), "stopReason": json_values})
bodies = st.one_of(
    st.binary(max_size=300),
    documents.map(lambda d: json.dumps(d, allow_nan=True).encode()),
    st.integers(min_value=1, max_value=6000).map(lambda n: b"[" * n + b"]" * n),
)
header_values = st.one_of(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
                          st.integers(min_value=-5, max_value=2**70).map(str))


@st.composite
def requests(draw: Any) -> bytes:
    """A push request with each part either valid or drawn from hostile values."""
    method = draw(st.sampled_from(["POST", "GET", "PUT", "POST", "post", ""]))
    path = draw(st.one_of(st.just(PATH), st.just("/v1/progress/ml/gpt/u1"), st.just(PATH + "/x"),
                          st.just("/v1/progress/ml/gpt/u1/99999999999"), st.text(max_size=40).map(lambda t: "/" + t)))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "", "HTTP/1.1 x"]))
    body = draw(bodies)
    headers = {"Authorization": draw(st.sampled_from([f"Bearer {TOKEN}", "Bearer x", "", TOKEN])),
               "Seqtrain-Push-Sequence": draw(st.one_of(st.integers(min_value=1, max_value=10**6).map(str),
                                                        header_values))}
    length = draw(st.one_of(st.just(str(len(body))), header_values, st.just(None)))
    if length is not None:
        headers["Content-Length"] = length
    if draw(st.booleans()):
        headers["Transfer-Encoding"] = "chunked"
    extra = draw(st.lists(st.tuples(st.text(max_size=10), header_values), max_size=3))
    lines = [f"{method} {path} {version}", *(f"{k}: {v}" for k, v in headers.items()),
             *(f"{k}: {v}" for k, v in extra)]
    cut = draw(st.integers(min_value=0, max_value=len(body)))  # a client that stops sending (EOF) in the body
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogatepass") + body
    return raw[:len(raw) - cut] if draw(st.booleans()) else raw


async def _exchange(raw: bytes) -> int | None:
    server = push.PushServer(push.PushedProgress(), KEY)
    reader = asyncio.StreamReader(limit=push.MAX_HEAD_BYTES)
    reader.feed_data(raw)
    reader.feed_eof()
    try:
        status, _ = await asyncio.wait_for(server._exchange(reader, push._Conn(None, 0.0)), 5)  # type: ignore[arg-type]
    except push._Refused as exc:
        status = exc.status
    except asyncio.IncompleteReadError:
        return None  # the client hung up mid-request: nobody to answer
    return status


@given(requests() | st.binary(max_size=400))
@example(b"POST " + PATH.encode() + b" HTTP/1.1\r\nContent-Length: -1\r\n\r\n")
@example(b"POST " + PATH.encode() + b" HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode()
         + b"\r\nSeqtrain-Push-Sequence: 1\r\nContent-Length: 10000\r\n\r\n" + b"[" * 5000 + b"]" * 5000)
@example(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a TLS hello
@example(b"POST " + PATH.encode() + b" HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!")
def test_the_push_endpoint_answers_any_request_with_a_2xx_or_4xx(raw):
    status = asyncio.run(_exchange(raw))
    assert status is None or status in ANSWERS, (status, raw[:200])


@given(bodies, st.one_of(st.just("1"), header_values, st.none()))
@example(b"[" * 5000 + b"]" * 5000, "1")
@example(json.dumps({"step": 1e30, "loss": float("nan"), "attempt": 1}).encode(), "1")
def test_the_push_store_takes_or_refuses_any_body_with_its_own_token(body, sequence):
    store = push.PushedProgress()
    status, reason = store.accept(KEY, "ml", "gpt", "u1", 1, f"Bearer {TOKEN}", sequence, body)
    assert status in {204, 400, 409, 413}, (status, reason)
    assert "\n" not in reason


@pytest.fixture(scope="module")
def trainer_server():
    server = httpserve.serve(0, "127.0.0.1", {"/progress": lambda: (200, "application/json", b"{}")}, "progress",
                             timeout=2.0)
    assert server is not None
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@given(st.one_of(
    st.binary(max_size=300),
    st.builds(lambda m, p, h: f"{m} {p} HTTP/1.0\r\n{h}\r\n\r\n".encode("utf-8", "surrogatepass"),
              st.sampled_from(["GET", "POST", "HEAD", "BREW"]), st.text(max_size=30).map(lambda t: "/" + t),
              st.text(max_size=60))))
@example(b"GET /progress HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello")
def test_the_trainers_server_answers_any_request_or_closes(trainer_server, raw):
    with socket.create_connection(("127.0.0.1", trainer_server), timeout=10) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)  # the client has said all it will: the server answers or closes
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    if out:
        assert out.startswith(b"HTTP/1."), out[:100]
        assert 200 <= int(out.split(b" ", 2)[1]) < 500, out[:100]
