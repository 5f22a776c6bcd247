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
)

from seqtrain_operator.k8s import reconcile
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
    cfg.push_port = push_port
    op = OperatorThread(cfg, b.webhook()).start()
    try:
        submit(cp, held_job("held", ns))

        def stepping() -> dict[str, Any] | None:
            st = status(cp, ns, "held")
            assert st.get("phase") != "Failed", st
            pushed = condition(st, "Progressing").get("message") == "progress pushed by rank 0"
            return st if (st.get("progress") or {}).get("step", 0) >= 1 and st.get("attempt") == 1 and pushed else None

        wait_for(stepping, START_TIMEOUT, what="status.progress of attempt 1 from pushes", interval=1)
        assert cfg.pushed.accepted >= 1 and not cfg.pushed.refused
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
