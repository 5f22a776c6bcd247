"""Progress pushed by rank 0 (issue 24, item 8), on the real control plane: the operator cannot reach the pods
(every poll of rank 0's progress endpoint goes to a port nothing listens on, as under a default-deny NetworkPolicy
or an mTLS mesh), yet status.progress follows training from rank 0's pushes, and a trainer that stops stepping is
restarted as Hung: hang detection works from pushed progress alone. Without the push the same job's progress stays
unknown (ProgressUnknown) and the hang is never detected.

The operator runs in this process (tests/integration/operator_harness.py) with its push endpoint on a free port;
the node agent runs the trainer as a real process (examples/k8s-cpu.yaml, one replica), which holds after step 3
(SEQTRAIN_FAULT_HOLD_AT_STEP, first attempt only).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import yaml
from operator_harness import (
    OperatorThread,
    condition,
    events,
    fast_config,
    module_env,
    namespace,
    patch_job,
    status,
    submit,
    wait_for,
    wait_phase,
)

from seqtrain_operator.k8s.passes import reconcile
from testbed.fixtures import ROOT, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

HOLD_AT = 3
START_TIMEOUT = 900  # the trainer's first step on a loaded 2-core machine: a deadline, not a measurement


@pytest.fixture(scope="module")
def env(seqtrain_operator, tmp_path_factory):
    yield from module_env(seqtrain_operator, tmp_path_factory.mktemp("kube"), operator=False)


def held_job(name: str, ns: str) -> dict[str, Any]:
    job = yaml.safe_load((ROOT / "examples" / "k8s-cpu.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": ns}
    spec = job["spec"]
    spec["replicas"] = 1
    spec["training"]["steps"] = 40
    del spec["checkpoint"]["pvc"]  # the pod's own emptyDir: the restart is what matters here
    spec["scheduling"] = {"topology": {"policy": "none"}, "nodeSelector": {"seqtrain.dev/testbed-agent": "true"}}
    # a limit the start-up (imports, rendezvous) never reaches on a loaded machine; shortened once training runs
    spec["faultTolerance"] = {"maxRestarts": 3, "backoffSeconds": 0, "inPlaceRestarts": 0, "hangTimeoutSeconds": 600}
    hold = [{"name": "SEQTRAIN_FAULT_HOLD_AT_STEP", "value": f"{HOLD_AT}:900"},
            {"name": "SEQTRAIN_FAULT_ATTEMPT", "value": "1"}]
    spec["podTemplate"] = {"spec": {"containers": [{"name": "trainer", "env": hold}]}}
    return job


def test_pushed_progress_reaches_the_status_and_a_hang_is_detected_when_polling_cannot_reach_the_pod(
        env, seqtrain_operator, monkeypatch):
    b, pools = env
    cp = b.cp
    ns = namespace(cp, "push")
    pools.append(ns)
    # The network between the operator and the pods drops the operator's connections: every poll goes to a closed
    # port (the real poll, over TCP; only its port is not the trainer's).
    closed, real_poll = free_port(), reconcile.poll_progress

    async def blocked_poll(ip: str, port: int, timeout: float = 2.0):
        return await real_poll(ip, closed, timeout)

    monkeypatch.setattr(reconcile, "poll_progress", blocked_poll)
    push_port = free_port()
    cfg = fast_config(progress_port=free_port(), master_port=seqtrain_operator.master_port,
                      termination_grace_seconds=30, progress_push_url=f"http://127.0.0.1:{push_port}",
                      push_key=os.urandom(32))
    op = OperatorThread(dataclasses.replace(cfg, push_port=push_port), b.webhook()).start()
    try:
        submit(cp, held_job("held", ns))

        def stepping() -> dict[str, Any] | None:
            st = status(cp, ns, "held")
            assert st.get("phase") != "Failed", st
            pushed = condition(st, "Progressing").get("message") == "progress pushed by rank 0"
            return st if (st.get("progress") or {}).get("step", 0) >= 1 and st.get("attempt") == 1 and pushed else None

        wait_for(stepping, START_TIMEOUT, what="status.progress of attempt 1 from pushes", interval=1)
        assert op.runtime.reconciler is not None
        pushed = op.runtime.reconciler.pushed
        assert pushed.accepted >= 1 and not pushed.refused
        # the trainer holds after step 3; a hang is now declared after 20 s without a step
        patch_job(cp, ns, "held", {"spec": {"faultTolerance": {"hangTimeoutSeconds": 20}}})

        def hung() -> dict[str, Any] | None:
            st = status(cp, ns, "held")
            assert st.get("phase") != "Failed", st
            return st if st.get("restarts", 0) >= 1 and any(r == "Hung" for r, _ in events(cp, ns)) else None

        wait_for(hung, 300, what="the held trainer restarted as Hung", interval=1)
        said = next(m for r, m in events(cp, ns) if r == "Hung")
        assert "no training step completed" in said and "hangTimeoutSeconds = 20" in said, said
        assert "ProgressUnknown" not in {r for r, _ in events(cp, ns)}
    finally:
        op.stop()


# Hostile progress documents (issue 35, item 4), polled by the real operator from a server that stands between it
# and the trainer: the trainer's own document with a NaN / +-Infinity loss, a step of 1e30, a 5000-deep body, an
# updatedAt from the future. Each pass is answered by the next one in turn.
HOSTILE = ("future", "nan", "step1e30", "inf", "deep", "-inf")


class HostileProgress:
    """Serves GET /progress: the trainer's document (fetched from where the operator meant to poll) made hostile.

    The trainer's document is fetched by a thread of its own and served from there: fetched inside each poll, it
    took part of the operator's poll timeout (1 s), and on a loaded machine the poll gave up on answers counted
    here as served (a full run saw every hostile answer "served" and none reach the status)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.target: tuple[str, int] | None = None
        self.served: dict[str, int] = dict.fromkeys(HOSTILE, 0)
        self._turn = 0
        self._doc: dict[str, Any] | None = None  # the trainer's latest document
        self._closed = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = outer.body()
                self.send_response(200 if body is not None else 502)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        """Keep the trainer's latest document, once the operator has said where the trainer serves it."""
        import json
        import urllib.request

        while not self._closed.wait(0.3):
            if self.target is None:
                continue
            ip, port = self.target
            try:
                with urllib.request.urlopen(f"http://{ip}:{port}/progress", timeout=5.0) as resp:
                    self._doc = json.loads(resp.read(65536))
            except (OSError, ValueError):
                pass

    def body(self) -> bytes | None:
        import json

        if self._doc is None:
            return None
        doc = dict(self._doc)
        mode = HOSTILE[self._turn % len(HOSTILE)]
        self._turn += 1
        self.served[mode] += 1
        if mode == "deep":
            return b'{"step": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        doc |= {"nan": {"loss": float("nan")}, "inf": {"loss": float("inf")}, "-inf": {"loss": float("-inf")},
                "step1e30": {"step": 1e30}, "future": {"updatedAt": "2999-01-01T00:00:00Z"}}[mode]
        return json.dumps(doc).encode()  # json.dumps writes NaN / Infinity bare, as a broken trainer would

    def close(self) -> None:
        self._closed.set()
        self.server.shutdown()
        self.server.server_close()


def test_hostile_progress_is_made_safe_and_the_job_still_finishes(env, seqtrain_operator, monkeypatch):
    b, pools = env
    cp = b.cp
    ns = namespace(cp, "nanprog")
    pools.append(ns)
    hostile, real_poll = HostileProgress(), reconcile.poll_progress

    async def hostile_poll(ip: str, port: int, timeout: float = 2.0):
        hostile.target = (ip, port)
        return await real_poll("127.0.0.1", hostile.port, timeout)  # the real poll and reader, a hostile answer

    monkeypatch.setattr(reconcile, "poll_progress", hostile_poll)
    cfg = fast_config(progress_port=free_port(), master_port=seqtrain_operator.master_port,
                      termination_grace_seconds=30)
    op = OperatorThread(cfg, b.webhook()).start()
    try:
        job = held_job("nanprog", ns)
        job["spec"]["training"]["steps"] = 30
        job["spec"]["faultTolerance"] = {"maxRestarts": 0, "backoffSeconds": 0, "inPlaceRestarts": 0}
        # held after step 3 for 45 s (a window of hostile polls however fast the machine trains), then on to the end
        job["spec"]["podTemplate"]["spec"]["containers"][0]["env"][0]["value"] = f"{HOLD_AT}:45"
        submit(cp, job)

        def diverging() -> dict[str, Any] | None:
            st = status(cp, ns, "nanprog")
            assert st.get("phase") not in ("Failed", "Succeeded"), (st, hostile.served)
            p = st.get("progress") or {}
            # a NaN or Infinity loss reached the status as null, flagged, in a status write the API server took
            return st if p.get("lossNonFinite") is True and "loss" not in p and p.get("step", 0) >= 1 else None

        wait_for(diverging, START_TIMEOUT, what="status.progress.lossNonFinite from a polled NaN loss", interval=0.5)
        done = wait_phase(cp, ns, "nanprog", "Succeeded", timeout=START_TIMEOUT)
        assert done["progress"]["step"] == 30, done["progress"]  # the termination message's final word
        assert done.get("restarts", 0) == 0, done
        assert all(n >= 1 for n in hostile.served.values()), hostile.served  # every hostile answer was polled
    finally:
        op.stop()
        hostile.close()
