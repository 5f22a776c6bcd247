"""Progress pushed by rank 0 to the operator (`POST <url>/v1/progress/<namespace>/<job>/<job uid>`), for clusters
where the operator cannot reach the pods (a default-deny NetworkPolicy, an mTLS mesh, an operator outside the
cluster): the trainer opens the connection, so only egress from the pod to the operator's Service is needed.

Authentication: each job's pods get a token, HMAC-SHA256(operator key, "<namespace>/<job>/<uid>"), from the pod
manifest (env SEQTRAIN_PROGRESS_PUSH_TOKEN); the operator recomputes it from the URL and compares in constant time.
A pod thus can push only its own job's progress: another job's token needs the key, and a re-created job of the
same name has another uid. The body is read up to MAX_BODY_BYTES (as a polled one) and parsed by the same parser.

What was pushed is kept in memory (`PushedProgress`, in `reconcile.Config`) with the time it arrived; a pass uses
it while it is fresh (rank 0 repeats its document every few seconds even when no step completed, so a fresh but
unchanged document is a hang, not a lost channel) and polls otherwise. Only the active operator's pushes count:
with several replicas a push reaches one of them (one connection per push, so the Service spreads them).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from seqtrain_operator.k8s.observe import Reported, progress_from_json
from seqtrain_operator.k8s.progress import MAX_BODY_BYTES
from seqtrain_operator.k8s.pushauth import PUSH_PATH, valid_token

log = logging.getLogger("seqtrain.operator")


@dataclass(frozen=True)
class Pushed:
    uid: str
    reported: Reported
    received: float  # time.monotonic() when it arrived


@dataclass
class PushedProgress:
    """The last accepted push per job, and counts of what was refused (by HTTP status)."""

    jobs: dict[tuple[str, str], Pushed] = field(default_factory=dict)
    refused: Counter[int] = field(default_factory=Counter)
    accepted: int = 0

    def accept(self, key: bytes, namespace: str, name: str, uid: str, authorization: str | None, body: bytes,
               now: float | None = None) -> tuple[int, str]:
        """(HTTP status, reason) of one push, checked against the operator's `key`; 204 when it was stored."""
        status, reason = self._check(key, namespace, name, uid, authorization, body, now)
        if status == 204:
            self.accepted += 1
        else:
            self.refused[status] += 1
        return status, reason

    def _check(self, key: bytes, namespace: str, name: str, uid: str, authorization: str | None, body: bytes,
               now: float | None) -> tuple[int, str]:
        if not key:
            return 404, "progress push is off"
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not valid_token(key, namespace, name, uid, token.strip()):
            return 403, "the token is not this job's"
        if len(body) > MAX_BODY_BYTES:
            return 413, f"a progress document is at most {MAX_BODY_BYTES} bytes"
        try:
            reported = progress_from_json(json.loads(body))
        except ValueError:
            reported = Reported()
        if reported.progress is None:
            return 400, "not a progress document"
        self.jobs[(namespace, name)] = Pushed(uid, reported, time.monotonic() if now is None else now)
        return 204, ""

    def fresh(self, namespace: str, name: str, uid: str, max_age: float, attempt: int | None = None,
              now: float | None = None) -> Reported | None:
        """The job's pushed progress if it arrived within `max_age` seconds, from this job (uid) and, when the
        document names one, from `attempt` (a dying gang's rank 0 may still push)."""
        p = self.jobs.get((namespace, name))
        if p is None or p.uid != uid or (time.monotonic() if now is None else now) - p.received > max_age:
            return None
        pushed_attempt = p.reported.progress.attempt if p.reported.progress is not None else None
        if attempt is not None and pushed_attempt is not None and pushed_attempt != attempt:
            return None
        return p.reported

    def forget(self, namespace: str, name: str) -> None:
        self.jobs.pop((namespace, name), None)


async def serve(store: PushedProgress, key: bytes, port: int, addr: str = "0.0.0.0"):  # noqa: ANN201 - aiohttp's AppRunner
    """Serve the push endpoint in the running event loop (kopf's); returns the runner (`await runner.cleanup()`)."""
    from aiohttp import web

    async def push(request: web.Request) -> web.Response:
        m = request.match_info
        length = request.content_length
        if length is not None and length > MAX_BODY_BYTES:
            store.refused[413] += 1
            return web.Response(status=413, text=f"a progress document is at most {MAX_BODY_BYTES} bytes\n")
        body = await request.content.read(MAX_BODY_BYTES + 1)
        status, reason = store.accept(key, m["namespace"], m["name"], m["uid"], request.headers.get("Authorization"),
                                      body)
        if status != 204:
            log.debug("progress push for %s/%s refused: %d %s", m["namespace"], m["name"], status, reason)
            return web.Response(status=status, text=reason + "\n")
        return web.Response(status=204)

    app = web.Application(client_max_size=MAX_BODY_BYTES + 1)
    app.router.add_post(PUSH_PATH + "/{namespace}/{name}/{uid}", push)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, addr, port).start()
    return runner
