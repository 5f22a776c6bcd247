"""status.checkpointPolicy and status.workAtRisk on the real control plane (scripts/testbed.sh): the chart's
prior reaches the trainer, the trainer's figures reach the custom resource through the progress endpoint the
operator polls, and after a failure the next attempt is told of it (its ConfigMap) and measures the MTBF itself.
Every wait has a deadline; no assertion is about timing."""

from __future__ import annotations

import os
import signal

import pytest
from test_testbed_e2e import cpu_job, job_status, wait_phase

from testbed.fixtures import TB, Operator, Testbed, wait

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 900  # a deadline for a 2-rank CPU run on a loaded 2-core machine, not a measurement
CHART_RANK_MTBF_HOURS = 50000  # charts/seqtrain/values.yaml operator.rankMtbfHours


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    return testbed.checkpoint_namespace("ckpt-policy")


def test_checkpoint_policy_and_work_at_risk_appear_on_the_custom_resource(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    job = cpu_job("ckpt-auto", hold_at_step=8)  # the first gang holds after step 8 until it is terminated
    job["spec"]["checkpoint"]["intervalSteps"] = "auto"
    # The async save of step 3 is published after the gang holds at step 8 (its write sleeps 10 s first, as on a
    # loaded machine): the trainer reports it all the same (seqtrain.obs.callbacks, the watcher), so lastCheckpoint
    # arrives while the gang holds. Before that watcher it stayed empty for good (seen in a full run).
    env = job["spec"]["podTemplate"]["spec"]["containers"][0]["env"]
    env += [{"name": "SEQTRAIN_FAULT_IN_SAVE", "value": "sleep:10"}, {"name": "SEQTRAIN_FAULT_SAVE_STEP", "value": "3"}]
    testbed.apply(job, ns)

    def held() -> dict | None:
        st = job_status(testbed, ns, "ckpt-auto")
        risk = st.get("workAtRisk") or {}
        ready = risk.get("steps", 0) >= 5 and (st.get("checkpointPolicy") or {}).get("saveSeconds")
        return st if ready and st.get("lastCheckpoint") else None
    st = wait("ckpt-auto held at step 8 with its policy in status", held, RUN_TIMEOUT, 1)
    policy, risk = st["checkpointPolicy"], st["workAtRisk"]
    # auto saved once early (step 3) to measure the save; the chart's prior over 2 ranks says: nothing more soon
    assert policy["sources"] == {"intervalSteps": "youngDaly", "saveSeconds": "measured", "mtbfSeconds": "prior"}
    assert policy["failures"] == 0 and policy["mtbfSeconds"] >= CHART_RANK_MTBF_HOURS * 3600 / 2
    assert policy["intervalSteps"] > job["spec"]["training"]["steps"]
    assert risk["checkpointStep"] == 3 and risk["steps"] == 5 and risk["checkpointAgeSeconds"] >= 0
    assert st["lastCheckpoint"]["step"] == 3

    # A rank dies: the next attempt is told of the failure and the MTBF is the job's own from then on.
    victim = testbed.get("pods", namespace=ns, selector="seqtrain.dev/job=ckpt-auto,seqtrain.dev/replica=1")[0]
    pid = testbed.pod_pid(victim["metadata"]["uid"])
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    done = wait_phase(testbed, seqtrain_operator, ns, "ckpt-auto", "Succeeded")
    policy = done["checkpointPolicy"]
    assert policy["failures"] == 1 and policy["sources"]["mtbfSeconds"] == "measured", policy
    assert policy["mtbfSeconds"] == pytest.approx(policy["exposureSeconds"], rel=1e-3)
    steps = job["spec"]["training"]["steps"]
    assert done["workAtRisk"]["checkpointStep"] == steps and done["workAtRisk"]["steps"] == 0
    assert (TB / "volumes" / ns / "ckpt-auto" / "checkpoints" / f"step-{steps}").is_dir()
