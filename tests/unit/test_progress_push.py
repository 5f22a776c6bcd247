"""Progress pushed by rank 0 to the operator (seqtrain.obs.push -> seqtrain_operator.k8s.progress.push): the per-job
token, the body checks, freshness, the coalescing sender, the wire between the two, the pod env and the pass's choice of
source."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_controller import T0, gang, make_job, run_to_running

import jobs
from seqtrain.obs.push import ProgressPusher
from seqtrain.runtime.launch import free_port
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import Progress
from seqtrain_operator.controller import Observed, decide, iso
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.passes import reconcile
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.pods.pushauth import TOKEN_FILE, TOKEN_FILE_ENV, URL_ENV, job_token, push_url
from seqtrain_operator.k8s.progress.poll import MAX_BODY_BYTES
from seqtrain_operator.k8s.progress.push import PushedProgress, serve
from seqtrain_operator.k8s.settings import Settings

KEY = b"k" * 32
DOC = json.dumps({"step": 7, "totalSteps": 10, "attempt": 2, "updatedAt": "2026-01-01T00:00:00Z"}).encode()


def bearer(ns: str = "ml", name: str = "gpt", uid: str = "u1", key: bytes = KEY, attempt: int = 2) -> str:
    return f"Bearer {job_token(key, ns, name, uid, attempt)}"


# ---- the operator's checks ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("auth", "body", "status"), [
    (bearer(), DOC, 204),
    (bearer(name="other"), DOC, 403),  # another job's token
    (bearer(uid="u0"), DOC, 403),  # the token of an earlier job of the same name
    (bearer(attempt=1), DOC, 403),  # the token of another attempt
    (bearer(key=b"x" * 32), DOC, 403),  # not signed with this operator's key
    (job_token(KEY, "ml", "gpt", "u1", 2), DOC, 403),  # no scheme
    (None, DOC, 403),
    (bearer(), b"{" + b" " * MAX_BODY_BYTES + b"}", 413),
    (bearer(), b"not json", 400),
    (bearer(), b'{"loss": 1.0}', 400),  # no step: not a progress document
])
def test_a_push_is_stored_only_with_its_own_jobs_token_and_a_progress_document(auth, body, status):
    store = PushedProgress()
    assert store.accept(KEY, "ml", "gpt", "u1", 2, auth, "1", body, now=100.0)[0] == status
    assert (store.fresh("ml", "gpt", "u1", 30, now=100.0) is not None) == (status == 204)
    assert store.accepted + sum(store.refused.values()) == 1


def test_without_a_key_nothing_is_accepted():
    assert PushedProgress().accept(b"", "ml", "gpt", "u1", 2, bearer(key=b""), "1", DOC)[0] == 404


def test_pushed_progress_counts_while_fresh_for_this_uid_and_attempt():
    store = PushedProgress()
    store.accept(KEY, "ml", "gpt", "u1", 2, bearer(), "1", DOC, now=100.0)
    got = store.fresh("ml", "gpt", "u1", 30, attempt=2, now=129.0)
    assert got is not None and got.progress.step == 7
    assert store.fresh("ml", "gpt", "u1", 30, now=131.0) is None  # stale: the pass polls instead
    assert store.fresh("ml", "gpt", "u2", 30, now=100.0) is None  # a re-created job of the same name
    assert store.fresh("ml", "gpt", "u1", 30, attempt=3, now=100.0) is None  # a dying gang's rank 0
    store.forget("u1")
    assert store.fresh("ml", "gpt", "u1", 30, now=100.0) is None


# ---- the trainer's sender ---------------------------------------------------------------------------------------

class Sink:
    """An HTTP endpoint that records what is POSTed to it."""

    def __init__(self, status: int = 204) -> None:
        self.requests: list[tuple[str, str | None, bytes]] = []
        self.sequences: list[int] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                sink.requests.append((self.path, self.headers.get("Authorization"), body))
                sink.sequences.append(int(self.headers.get("Seqtrain-Push-Sequence") or 0))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/progress/ml/gpt/u1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wait_until(fn, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_updates_are_coalesced_to_one_push_per_interval_and_the_last_document_is_sent():
    sink, state = Sink(), {"step": 0}
    pusher = ProgressPusher(sink.url, "tok", lambda: json.dumps(state).encode(), interval=0.5, heartbeat=60)
    try:
        started = time.monotonic()
        for step in range(1, 201):  # 200 steps' updates as fast as they come
            state["step"] = step
            pusher.poke()
        elapsed = time.monotonic() - started
        wait_until(lambda: sink.requests and json.loads(sink.requests[-1][2])["step"] == 200)
        assert len(sink.requests) <= 2 + int(elapsed / 0.5)
        assert sink.requests[-1][:2] == ("/v1/progress/ml/gpt/u1", "Bearer tok")
    finally:
        pusher.close()
        sink.close()
    assert pusher.failed == 0


def test_with_no_update_the_document_is_pushed_again_as_a_heartbeat():
    sink = Sink()
    pusher = ProgressPusher(sink.url, "tok", lambda: DOC, interval=0.05, heartbeat=0.1)
    try:
        wait_until(lambda: len(sink.requests) >= 3)
    finally:
        pusher.close()
        sink.close()


def test_failed_pushes_are_counted_and_never_raised_or_waited_for():
    refusing = Sink(status=403)
    url = refusing.url
    refusing.close()  # nothing listens there now
    pusher = ProgressPusher(url, "tok", lambda: DOC, interval=0.01, heartbeat=0.05, timeout=0.5)
    started = time.monotonic()
    for _ in range(1000):
        pusher.poke()
    assert time.monotonic() - started < 0.5  # poke only sets an event
    wait_until(lambda: pusher.failed >= 2)
    pusher.close()
    assert pusher.sent == 0 and pusher.last_error


def test_close_sends_the_final_document():
    sink, state = Sink(), {"step": 1}
    pusher = ProgressPusher(sink.url, "tok", lambda: json.dumps(state).encode(), interval=60, heartbeat=60)
    pusher.poke()
    wait_until(lambda: sink.requests)  # the first push
    state["step"], state["stopReason"] = 9, "EarlyStopped"
    pusher.close()
    sink.close()
    assert json.loads(sink.requests[-1][2]) == {"step": 9, "stopReason": "EarlyStopped"}


def test_the_pusher_is_configured_from_the_pod_env_and_reads_its_token_from_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv(URL_ENV, raising=False)
    assert ProgressPusher.from_env(lambda: DOC) is None
    monkeypatch.setenv(URL_ENV, "http://127.0.0.1:9/x")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    assert ProgressPusher.from_env(lambda: DOC) is None  # no token file (yet): the operator polls
    (tmp_path / "token").write_text("t0k\n")
    pusher = ProgressPusher.from_env(lambda: DOC, timeout=0.2)
    assert pusher is not None and pusher.url == "http://127.0.0.1:9/x" and pusher._token == "t0k"
    pusher.close()


def test_every_push_carries_a_larger_sequence_number_than_the_last_even_after_a_restart():
    sink = Sink()
    first = ProgressPusher(sink.url, "tok", lambda: DOC, interval=0.01, heartbeat=0.02)
    try:
        wait_until(lambda: len(sink.sequences) >= 5)
    finally:
        first.close()
    again = ProgressPusher(sink.url, "tok", lambda: DOC, interval=0.01, heartbeat=0.02)  # the process restarted
    try:
        n = len(sink.sequences)
        wait_until(lambda: len(sink.sequences) >= n + 3)
    finally:
        again.close()
        sink.close()
    assert sink.sequences == sorted(set(sink.sequences)) and sink.sequences[0] > 0, sink.sequences


# ---- trainer -> operator, over the wire ------------------------------------------------------------------------

def test_a_trainers_push_reaches_the_operators_endpoint_and_a_forged_one_does_not():
    store, loop, ready = PushedProgress(), asyncio.new_event_loop(), threading.Event()
    runner: list = []
    port = free_port()

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner.append(loop.run_until_complete(serve(store, KEY, port, "127.0.0.1")))
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    assert ready.wait(10)
    base = f"http://127.0.0.1:{port}"
    try:
        forged = ProgressPusher(push_url(base, "ml", "other", "u9", 2), job_token(KEY, "ml", "gpt", "u1", 2),
                                lambda: DOC, heartbeat=60)
        good = ProgressPusher(push_url(base, "ml", "gpt", "u1", 2), job_token(KEY, "ml", "gpt", "u1", 2), lambda: DOC,
                              heartbeat=60)
        forged.poke()
        good.poke()
        wait_until(lambda: good.sent >= 1 and forged.failed >= 1)
        forged.close()
        good.close()
        assert store.fresh("ml", "gpt", "u1", 30).progress.step == 7
        assert store.fresh("ml", "other", "u9", 30) is None and store.refused[403] >= 1
    finally:
        asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


# ---- the pod manifest and the reconcile pass --------------------------------------------------------------------

def _job() -> SeqTrainJob:
    return SeqTrainJob.model_validate(jobs.make_job("gpt", "ml", replicas=1,
                                                    resources={"gpus": 0, "cpu": "1", "memory": "1Gi"}))


def test_pods_get_their_attempts_push_url_and_token_file_only_when_push_is_configured():
    owner = Owner(name="gpt", namespace="ml", uid="u1")
    env = lambda s: {e["name"]: e.get("value") for e in m.build_pod(_job(), owner, 1, 0, s, None)  # noqa: E731
                     ["spec"]["containers"][0]["env"]}
    assert URL_ENV not in env(m.Settings())
    on = env(m.Settings(progress_push_url="http://op.seqtrain-system.svc:8472/", push_key=KEY))
    assert on[URL_ENV] == "http://op.seqtrain-system.svc:8472/v1/progress/ml/gpt/u1/1"
    assert on[TOKEN_FILE_ENV] == TOKEN_FILE
    assert KEY.decode() not in repr(m.Settings(push_key=KEY))


def _running_rank0() -> list[dict]:
    return [{"metadata": {"labels": {m.LABEL_REPLICA: "0", m.LABEL_ATTEMPT: "2"}},
             "status": {"phase": "Running", "podIP": "10.0.0.5"}}]


def _cfg(poll: bool = True) -> reconcile.Reconciler:
    pods = m.Settings(progress_push_url="http://op:8472", push_key=KEY)
    return reconcile.Reconciler(None, Settings(pods=pods, push_port=8472, poll_progress=poll))  # type: ignore[arg-type]


OWNER = Owner(name="gpt", namespace="ml", uid="u1")


async def _answers(step: int | None):
    from seqtrain_operator.k8s.pods.observe import Reported
    return Reported(Progress(step=step, total_steps=10)) if step is not None else Reported()


def test_a_pass_uses_fresh_pushed_progress_without_polling(monkeypatch):
    cfg = _cfg()
    cfg.pushed.accept(KEY, "ml", "gpt", "u1", 2, bearer(), "1", DOC)

    async def no_poll(*a, **k):
        raise AssertionError("polled although a fresh push was there")
    monkeypatch.setattr(reconcile, "poll_progress", no_poll)
    reported, unreachable, source = asyncio.run(cfg.progress(OWNER, _running_rank0(), 2))
    assert (reported.progress.step, unreachable, source) == (7, None, "pushed")


def test_without_a_fresh_push_a_pass_polls_and_says_when_neither_works(monkeypatch):
    cfg = _cfg()
    monkeypatch.setattr(reconcile, "poll_progress", lambda *a, **k: _answers(3))
    reported, unreachable, source = asyncio.run(cfg.progress(OWNER, _running_rank0(), 2))
    assert (reported.progress.step, unreachable, source) == (3, None, "polled")
    monkeypatch.setattr(reconcile, "poll_progress", lambda *a, **k: _answers(None))
    reported, unreachable, source = asyncio.run(cfg.progress(OWNER, _running_rank0(), 2))
    assert reported.progress is None and source is None
    assert "did not answer" in unreachable and "pushed nothing in the last 30s" in unreachable
    cfg = _cfg(poll=False)  # push only: a quiet channel pauses hang detection, as an unanswered poll does
    reported, unreachable, source = asyncio.run(cfg.progress(OWNER, _running_rank0(), 2))
    assert reported.progress is None and unreachable == "rank 0 pushed no progress in the last 30s"


def test_a_hang_is_detected_from_pushed_progress_and_the_condition_names_the_source():
    job = make_job(hang=60)
    st = run_to_running(job)
    fresh = Observed(replicas=gang(1, "Running", "Running"), progress=Progress(step=5, updated_at=iso(T0)),
                     progress_source="pushed")
    d = decide(job, st, fresh, T0 + timedelta(seconds=30))
    progressing = next(c for c in d.status.conditions if c.type == "Progressing")
    assert (progressing.reason, progressing.message) == ("StepsCompleting", "progress pushed by rank 0")
    assert decide(job, d.status, fresh, T0 + timedelta(seconds=90)).status.phase == "Restarting"
