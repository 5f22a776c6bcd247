"""The fault proxy itself, in front of a small upstream that answers like an apiserver (TLS, watch streams)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
from aiohttp import web

from testbed.faultproxy import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


class Upstream:
    """HTTPS on loopback: echoes requests as JSON; `?watch=1` streams three events, then holds the stream open
    until the client goes (an apiserver watch with nothing more to say)."""

    def __init__(self, cert: str, key: str):
        import ssl

        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.seen: list[tuple[str, str, str]] = []
        ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve(ready)), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    async def _serve(self, ready: threading.Event) -> None:
        self.stop_ev = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app)
        await runner.setup()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        await web.TCPSite(runner, "127.0.0.1", self.port, ssl_context=self.ctx).start()
        ready.set()
        await self.stop_ev.wait()
        await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.path_qs, request.headers.get("Authorization", "")))
        if request.query.get("watch") == "1":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(json.dumps({"type": "ADDED", "object": {"metadata": {"name": f"p{i}"}}}).encode()
                                 + b"\n")
            await asyncio.sleep(30)
            return resp
        code = 201 if request.method == "POST" else 200
        return web.json_response({"method": request.method, "path": request.path_qs,
                                  "body": json.loads(body) if body else None}, status=code,
                                 headers={"X-Upstream": "yes"})

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_ev.set)
        self.thread.join(10)


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "tls.crt"), str(d / "tls.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert], check=True,
                   capture_output=True)
    return cert, key


@pytest.fixture
def env(tls):
    up = Upstream(*tls)
    proxy = FaultProxy(upstream=f"https://127.0.0.1:{up.port}", ca_file=tls[0]).start()
    try:
        yield up, proxy
    finally:
        proxy.stop()
        up.stop()


AUTH = {"Authorization": "Bearer sa-token"}


def test_forwards_requests_with_the_callers_token_and_records_them(env):
    up, proxy = env
    r = requests.post(proxy.url + "/api/v1/namespaces/a/pods?dryRun=All", json={"kind": "Pod"}, headers=AUTH,
                      timeout=10)
    assert r.status_code == 201 and r.headers["X-Upstream"] == "yes"
    assert r.json() == {"method": "POST", "path": "/api/v1/namespaces/a/pods?dryRun=All", "body": {"kind": "Pod"}}
    assert up.seen == [("POST", "/api/v1/namespaces/a/pods?dryRun=All", "Bearer sa-token")]
    [rec] = proxy.requests("POST", r"/pods$")
    assert (rec.status, rec.query, rec.body, rec.injected) == (201, "dryRun=All", {"kind": "Pod"}, False)
    assert proxy.count("GET") == 0 and proxy.count(status=201) == 1


def test_status_rules_answer_a_kubernetes_status_without_forwarding_then_stop(env):
    up, proxy = env
    conflict = proxy.add_rule("PATCH", r"/seqtrainjobs/j/status$", status=409, times=2)
    errors = proxy.add_rule("*", r"/pods$", status=500, times=None, after=1)
    codes = [requests.patch(proxy.url + "/apis/seqtrain.dev/v1alpha1/namespaces/a/seqtrainjobs/j/status",
                            json={}, headers=AUTH, timeout=10).status_code for _ in range(3)]
    assert codes == [409, 409, 200] and conflict.hits == 2
    r = requests.get(proxy.url + "/apis/seqtrain.dev/v1alpha1/namespaces/a/seqtrainjobs/j/status", timeout=10)
    assert r.status_code == 200  # a GET of the same path was never the rule's
    body = requests.patch(proxy.url + "/apis/seqtrain.dev/v1alpha1/namespaces/a/seqtrainjobs/j/status", json={},
                          timeout=10)
    assert body.status_code == 200
    r = [requests.get(proxy.url + "/api/v1/namespaces/a/pods", timeout=10) for _ in range(3)]
    assert [x.status_code for x in r] == [200, 500, 500] and errors.hits == 2  # the first was let through
    assert r[1].json() == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": "injected by the test proxy (500)", "reason": "InternalError", "code": 500}
    assert proxy.count("PATCH", r"/status$", status=409) == 2 and proxy.count("GET", r"/pods$", status=500) == 2
    # only what the proxy let through reached the upstream
    assert sum(1 for m, p, _ in up.seen if m == "PATCH") == 2 and sum(1 for m, _, _ in up.seen if m == "GET") == 2


def test_a_429_says_retry_after_as_the_rule_asks(env):
    _, proxy = env
    proxy.add_rule("POST", r"/pods$", status=429, times=1)
    proxy.add_rule("POST", r"/pods$", status=429, times=1, retry_after=2.5)
    r = [requests.post(proxy.url + "/api/v1/namespaces/a/pods", json={}, headers=AUTH, timeout=10) for _ in range(3)]
    assert [x.status_code for x in r] == [429, 429, 201]
    assert [x.headers.get("Retry-After") for x in r[:2]] == ["1", "2.5"] and r[0].json()["reason"] == "TooManyRequests"


def test_a_rule_with_a_query_acts_only_on_requests_whose_query_matches(env):
    _, proxy = env
    listing = proxy.add_rule("GET", r"^/api/v1/pods$", query=r"fieldSelector=", status=500)
    assert requests.get(proxy.url + "/api/v1/pods?limit=5", timeout=10).status_code == 200
    assert requests.get(proxy.url + "/api/v1/pods?fieldSelector=status.phase%21%3DFailed",
                        timeout=10).status_code == 500
    assert listing.hits == 1


def test_delay_past_the_clients_timeout_is_a_timeout_and_the_next_request_passes(env):
    _, proxy = env
    hang = proxy.add_rule("GET", r"/api/v1/nodes$", delay=30.0)
    t0 = time.monotonic()
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(proxy.url + "/api/v1/nodes", timeout=1.0)
    assert time.monotonic() - t0 < 10 and hang.hits == 1
    assert requests.get(proxy.url + "/api/v1/nodes", timeout=10).status_code == 200


def _watch_lines(proxy: FaultProxy, path: str, read_timeout: float = 3.0,
                 events: list[dict] | None = None) -> tuple[list[dict], str]:
    """The events a watch client gets (appended to `events` as they come), and how the stream ended: 'cut' (broken
    mid-stream), 'end' (closed cleanly) or 'open' (still open when the client stopped waiting)."""
    events = [] if events is None else events
    try:
        with requests.get(proxy.url + path, stream=True, timeout=(5, read_timeout)) as r:
            for line in r.iter_lines():
                if line:
                    events.append(json.loads(line))
        return events, "end"
    except requests.exceptions.ChunkedEncodingError:
        return events, "cut"
    except requests.exceptions.ConnectionError as exc:
        return events, "open" if "timed out" in str(exc).lower() else "cut"


def test_watch_streams_pass_through_dropped_watches_and_410_gone(env):
    _, proxy = env
    path = "/api/v1/namespaces/a/pods?watch=1&resourceVersion=41"
    events, how = _watch_lines(proxy, path)
    assert [e["object"]["metadata"]["name"] for e in events] == ["p0", "p1", "p2"] and how == "open"

    drop = proxy.add_rule("GET", r"/pods$", drop_after=1)
    events, how = _watch_lines(proxy, path)
    assert [e["object"]["metadata"]["name"] for e in events] == ["p0"] and how == "cut" and drop.hits == 1
    assert requests.get(proxy.url + "/api/v1/namespaces/a/pods", timeout=10).status_code == 200  # lists untouched
    assert drop.hits == 1

    gone = proxy.add_rule("GET", r"/pods$", gone=True)
    events, how = _watch_lines(proxy, path)
    assert how == "end" and gone.hits == 1
    assert events == [{"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "too old resource version: 41 (1041)", "reason": "Expired", "code": 410}}]
    assert proxy.count("GET", r"/pods$", watch=True) == 3 and proxy.count("GET", r"/pods$", watch=False) == 1


def _open_watch(proxy: FaultProxy, read_timeout: float) -> tuple[threading.Thread, dict[str, tuple[list[dict], str]]]:
    """A watch of pods in a thread, returned once its three events are through (the stream then stays open);
    out["w"] is what `_watch_lines` says once the stream ends."""
    out: dict[str, tuple[list[dict], str]] = {}
    seen: list[dict] = []
    t = threading.Thread(target=lambda: out.setdefault("w", _watch_lines(
        proxy, "/api/v1/namespaces/a/pods?watch=1", read_timeout=read_timeout, events=seen)))
    t.start()
    deadline = time.monotonic() + 30
    while len(seen) < 3:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.05)
    return t, out


def test_drop_watches_cuts_the_open_streams_only(env):
    _, proxy = env
    t, out = _open_watch(proxy, read_timeout=20)
    assert proxy.drop_watches("/nodes") == 0  # not the open one
    assert proxy.drop_watches(r"/pods$") == 1
    t.join(10)
    events, how = out["w"]
    assert len(events) == 3 and how == "cut"
    assert proxy.drop_watches() == 0  # nothing open any more


def test_rules_are_checked_and_a_kubeconfig_points_at_the_proxy(env, tmp_path: Path):
    import yaml

    _, proxy = env
    with pytest.raises(ValueError, match="one of"):
        proxy.add_rule("GET", "/x", status=500, gone=True)
    with pytest.raises(ValueError, match="watch streams"):
        proxy.add_rule("GET", "/x", drop_after=0, watch=False)
    cfg = yaml.safe_load(Path(proxy.kubeconfig(str(tmp_path / "kc"), token="t0k")).read_text())
    assert cfg["clusters"][0]["cluster"]["server"] == proxy.url and cfg["users"][0]["user"]["token"] == "t0k"


def test_stop_with_a_watch_still_open_ends_the_proxy(tls):
    """A module's teardown stops its proxy while a watch the operator opened is still streaming: the proxy ends (its
    thread is gone when stop() returns) and the stream is cut, rather than waiting out aiohttp's 60-second graceful
    shutdown (stop() itself gives up after 30 s, so a lingering thread means that wait)."""
    up = Upstream(*tls)
    proxy = FaultProxy(upstream=f"https://127.0.0.1:{up.port}", ca_file=tls[0]).start()
    try:
        t, out = _open_watch(proxy, read_timeout=60)
        proxy.stop()
        assert proxy._thread is not None and not proxy._thread.is_alive()
        t.join(30)
        assert out["w"][1] in ("cut", "end"), out
    finally:
        proxy.stop()
        up.stop()
