"""An elastic gang (spec.minReplicas) on the real control plane: a node dies under half the gang, training goes on
at the smaller size from the checkpoint, and the gang grows back to its full size once the node returns.

Real processes: each replica is a rank process the node agent runs on cpu-0/cpu-1 (4 CPUs each). A replica asks
for 1.5 CPUs, so each node holds two and one node alone holds only two: the size the planner falls back to.
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from test_testbed_e2e import RUN_TIMEOUT, cpu_job, job_status, losses, wait_phase

from testbed.fixtures import Operator, Testbed, wait

pytestmark = pytest.mark.slow

NAME = "elastic"
STEPS = 30
HOLD = 15  # every attempt holds after this step until it is terminated: the test acts at known steps


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    return testbed.checkpoint_namespace("el")


def events(tb: Testbed, ns: str) -> list[dict]:
    out = tb.kubectl("get", "events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}", "-o", "json")
    return sorted(json.loads(out.stdout)["items"], key=lambda e: e.get("lastTimestamp") or e["eventTime"] or "")


def running_at(tb: Testbed, ns: str, replicas: int, attempt_above: int) -> dict | None:
    st = job_status(tb, ns, NAME)
    ok = st.get("phase") == "Running" and st.get("replicas") == replicas and st.get("attempt", 0) > attempt_above
    return st if ok else None


@pytest.mark.timeout(2 * RUN_TIMEOUT + 300)
def test_a_node_loss_shrinks_the_gang_and_its_return_grows_it_back(
        testbed: Testbed, seqtrain_operator: Operator, ns: str, node_back: list[str]) -> None:
    job = cpu_job(NAME)
    spec = job["spec"]
    spec["replicas"], spec["minReplicas"] = 4, 2
    spec["resources"]["cpu"] = "1500m"
    spec["training"].update(steps=STEPS, globalBatchSize=8, microBatchSize=2)
    spec["faultTolerance"]["maxRestarts"] = 0  # a restart charged to the user would fail the job
    hold = [{"name": "SEQTRAIN_FAULT_HOLD_AT_STEP", "value": f"{HOLD}:900"}]
    spec["podTemplate"] = {"spec": {"containers": [{"name": "trainer", "env": hold}]}}
    testbed.apply(job, ns)
    try:
        wait(f"4 replicas held at step {HOLD}", lambda: (job_status(testbed, ns, NAME).get("progress") or {})
             .get("step", 0) >= HOLD, RUN_TIMEOUT, 1)
        first = job_status(testbed, ns, NAME)
        assert first["replicas"] == 4 and first["worldSize"] == 4, first
        per_node: dict[str, int] = {}
        for p in first["placement"]:
            per_node[p["node"]] = per_node.get(p["node"], 0) + 1
        assert sorted(per_node.values()) == [2, 2], first["placement"]
        dead = first["placement"][-1]["node"]
        node_back.append(dead)
        t_down = datetime.now().astimezone()
        testbed.node_down(dead)
        testbed.fence(dead)  # an admin confirms it is down: its pods may be force-deleted (non-graceful shutdown)

        small = wait("the gang running at 2 replicas", lambda: running_at(testbed, ns, 2, first["attempt"]),
                     RUN_TIMEOUT, 1)
        t_small = datetime.now().astimezone()
        assert small["worldSize"] == 2 and all(p["node"] != dead for p in small["placement"]), small
        assert small["infraRestarts"] == 1 and small.get("restarts", 0) == 0, small
        warn = wait("the ScaledDown warning", lambda: [e for e in events(testbed, ns) if e["reason"] == "ScaledDown"], 60)
        assert warn and warn[-1]["type"] == "Warning" and "2 of 4 replicas" in warn[-1]["message"], warn
        assert "global batch 8 kept" in warn[-1]["message"]
        # The smaller gang trains: it passes the checkpoint it resumed from.
        resumed = (small.get("lastCheckpoint") or {}).get("step", 0)
        def trained_past_it() -> bool:  # a step of the smaller gang (after the node died), up to the hold
            p = job_status(testbed, ns, NAME).get("progress") or {}
            stamp = datetime.fromisoformat(p["updatedAt"]) if p.get("updatedAt") else None
            return p.get("step", 0) >= HOLD and stamp is not None and stamp > t_down
        wait(f"the 2-replica gang trained from step {resumed} to {HOLD}", trained_past_it, RUN_TIMEOUT, 1)

        testbed.node_up(dead)
        node_back.remove(dead)
        done = wait_phase(testbed, seqtrain_operator, ns, NAME, "Succeeded")
        assert done["replicas"] == 4 and done["worldSize"] == 4, done
        assert done.get("restarts", 0) == 0 and done["infraRestarts"] == 1, done  # growing back costs no budget
        reasons = [e["reason"] for e in events(testbed, ns)]
        assert "ScalingUp" in reasons and "ScaledUp" in reasons, reasons
        # Loss goes on from the checkpoint at each size change: every step once.
        loss = losses(ns, NAME)
        assert sorted(loss) == list(range(1, STEPS + 1))
        assert 0 < resumed < HOLD
        # The 2-replica gang redid steps resumed+1..HOLD on the same global batches from the same weights as the
        # 4-replica gang before the node died (only the reduction order differs): the same loss at HOLD.
        before = first["progress"]["loss"]
        assert loss[HOLD] == pytest.approx(before, abs=1e-3), (loss[HOLD], before)
        print(json.dumps({"resumed_from": resumed, "steps_lost": done.get("stepsLost"),
                          "loss_at_hold": {"4_replicas": before, "2_replicas": loss[HOLD]},
                          "seconds_to_run_smaller": round((t_small - t_down).total_seconds(), 1),
                          "loss": {str(k): round(v, 4) for k, v in sorted(loss.items())}}))
    finally:
        testbed.kubectl("delete", "stj", NAME, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=180s",
                        timeout=240)
