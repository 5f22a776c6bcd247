"""A crashed rank restarts the gang, on the real control plane (scripts/testbed.sh), as a new user tries it:
examples/k8s-cpu.yaml (2 replicas, 80 steps, a checkpoint every 20) on the node agent's CPU nodes, rank 1 killing
itself after step 40 in the first attempt only (SEQTRAIN_FAULT_* in the trainer container's env, via podTemplate).

Without a PVC every pod's checkpoint folder is its own emptyDir (as on any cluster): the ranks save nothing (the
folder is not shared; before, rank 1 crashed in the first save at every attempt and the job Failed) and the restarted
gang trains from scratch. With the PVC the restarted gang resumes from the checkpoint of step 20. Both: exactly one
restart, Succeeded, the reason of the failure the dead rank's, and the losses of an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.fixtures import ROOT, TB, Operator, Testbed, wait

pytestmark = pytest.mark.slow

STEPS, INTERVAL, KILL_AT = 80, 20, 40
RUN_TIMEOUT = 900  # seconds for both attempts of a 2-rank CPU run on a loaded 2-core machine; a deadline only


def crash_job(name: str, pvc: bool) -> dict[str, Any]:
    job = yaml.safe_load((ROOT / "examples" / "k8s-cpu.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"]["training"]["steps"] = STEPS
    job["spec"]["checkpoint"]["intervalSteps"] = INTERVAL
    if not pvc:
        del job["spec"]["checkpoint"]["pvc"]
    job["spec"]["scheduling"]["nodeSelector"] = {"seqtrain.dev/testbed-agent": "true"}
    env = [{"name": "SEQTRAIN_FAULT_KILL_AT_STEP", "value": f"{KILL_AT}:1"},
           {"name": "SEQTRAIN_FAULT_ATTEMPT", "value": "1"}]
    job["spec"]["podTemplate"] = {"spec": {"containers": [{"name": "trainer", "env": env}]}}
    # Re-creating the gang is what this test is about (in-place restarts: test_testbed_inplace_restart.py).
    job["spec"]["faultTolerance"]["inPlaceRestarts"] = 0
    return job


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    return testbed.checkpoint_namespace("crash")


def run_to_the_end(tb: Testbed, op: Operator, ns: str, name: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        st = ((tb.get("seqtrainjob", name, ns) or {}).get("status")) or {}
        if st.get("phase") == "Failed":
            pytest.fail(f"{name} failed: {st.get('message')}\noperator log:\n{op.logs()}", pytrace=False)
        return st if st.get("phase") == "Succeeded" else None
    return wait(f"{name} Succeeded", probe, RUN_TIMEOUT, interval=2)


def losses(metrics: Path) -> dict[int, float]:
    """step -> loss from a metrics.jsonl; a step twice is an error."""
    out: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        assert rec["step"] not in out, f"step {rec['step']} appears twice in {metrics}"
        out[rec["step"]] = rec["loss"]
    return out


def restarted_because_rank_1_died(tb: Testbed, ns: str, name: str) -> str:
    """The one restart's Warning event: the dead rank (replica 1, SIGKILL) named, not its peer's echo."""
    events = [e for e in tb.get("events", namespace=ns) if e["involvedObject"].get("name") == name
              and e["type"] == "Warning" and "restart 1/" in e["message"]]
    assert len(events) == 1, events
    message = events[0]["message"]
    assert message.startswith("replica 1 on cpu-") and "exit code 137 (killed by SIGKILL)" in message, message
    assert f"rank 1 kills itself after step {KILL_AT}" in message, message
    return message


def pod_folder(tb: Testbed, ns: str, name: str, attempt: int, replica: int) -> Path:
    (pod,) = tb.get("pods", namespace=ns, selector=f"seqtrain.dev/job={name},seqtrain.dev/attempt={attempt},"
                                                    f"seqtrain.dev/replica={replica}")
    return TB / "agent" / "pods" / pod["metadata"]["uid"]


@pytest.mark.timeout(2 * RUN_TIMEOUT + 300)
def test_a_crashed_rank_restarts_the_gang_once_and_the_job_succeeds(testbed: Testbed, seqtrain_operator: Operator,
                                                                    ns: str) -> None:
    op = seqtrain_operator
    # Without a PVC: each pod's emptyDir is its own, so no checkpoint; the second attempt trains from scratch.
    testbed.apply(crash_job("crash-emptydir", pvc=False), ns)
    done = run_to_the_end(testbed, op, ns, "crash-emptydir")
    assert (done["restarts"], done.get("infraRestarts", 0), done["attempt"]) == (1, 0, 2), done
    assert done["progress"]["step"] == STEPS
    message = restarted_because_rank_1_died(testbed, ns, "crash-emptydir")
    # Rank 0 reported no checkpoint: the operator does not claim one (the ranks' own search decides, below).
    assert "from checkpoint step ? (the newest the ranks find; none reported yet)" in message, message
    rank0 = pod_folder(testbed, ns, "crash-emptydir", 2, 0) / "volumes" / "checkpoints" / "crash-emptydir"
    scratch = losses(rank0 / "metrics.jsonl")
    assert sorted(scratch) == list(range(1, STEPS + 1))
    assert not list((rank0 / "checkpoints").glob("step-*"))

    # With the PVC: the second attempt resumes from step 20, and the loss goes on as if nothing happened.
    testbed.apply(crash_job("crash-pvc", pvc=True), ns)
    done = run_to_the_end(testbed, op, ns, "crash-pvc")
    assert (done["restarts"], done.get("infraRestarts", 0), done["attempt"]) == (1, 0, 2), done
    assert done["progress"]["step"] == STEPS
    # The event names the checkpoint the operator last saw through progress polling (at best step 20, but on a fast
    # machine the crash can come before a poll saw it): what the trainer resumed from is what counts, below.
    restarted_because_rank_1_died(testbed, ns, "crash-pvc")
    log = (pod_folder(testbed, ns, "crash-pvc", 2, 0) / "container.log").read_text()
    assert f"resumed from step {INTERVAL}" in log, log[-3000:]
    # Every step once, the same losses as the run that trained from scratch without interruption after its restart.
    assert losses(TB / "volumes" / ns / "crash-pvc" / "metrics.jsonl") == scratch
