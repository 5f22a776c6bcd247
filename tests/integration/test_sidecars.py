"""Sidecars on the real control plane (issue 24): a job whose pods carry a long-running sidecar (a log shipper)
ends when training does, Succeeded or Failed. The node agent runs the sidecar as a process next to the trainer, the
way the kubelet runs a pod's containers (tests/testbed/node_agent.py): an ordinary second container keeps the pod
Running after the trainer exits, a native sidecar is stopped once it has.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_testbed_e2e import cpu_job, job_status, losses, wait_phase

from testbed.fixtures import Operator, Testbed

pytestmark = pytest.mark.slow

STEPS = 20
SHIPPER = {"name": "log-shipper", "image": "busybox:1.36", "command": ["sleep", "3600"]}


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    return testbed.checkpoint_namespace("sidecar")


def with_sidecar(name: str, trainer_env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    job = cpu_job(name)
    job["spec"]["training"]["steps"] = STEPS
    containers: list[dict[str, Any]] = [SHIPPER]
    if trainer_env:
        containers.append({"name": "trainer", "env": trainer_env})
    job["spec"]["podTemplate"] = {"spec": {"containers": containers}}
    return job


def sidecar_states(tb: Testbed, ns: str, job: str) -> list[dict[str, Any]]:
    pods = tb.get("pods", namespace=ns, selector=f"seqtrain.dev/job={job}")
    return [c["state"] for p in pods for c in [*(p["status"].get("initContainerStatuses") or []),
                                                *(p["status"].get("containerStatuses") or [])]
            if c["name"] == SHIPPER["name"]]


def test_a_job_with_a_long_running_sidecar_succeeds_when_training_does(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    testbed.apply(with_sidecar("shipper-ok"), ns)
    done = wait_phase(testbed, seqtrain_operator, ns, "shipper-ok", "Succeeded")
    assert done["progress"]["step"] == STEPS and done.get("restarts", 0) == 0, done
    assert sorted(losses(ns, "shipper-ok")) == list(range(1, STEPS + 1))
    # The sidecar ran beside the trainer and was stopped once training ended (it would sleep for an hour).
    states = sidecar_states(testbed, ns, "shipper-ok")
    assert len(states) == 2 and all("terminated" in s for s in states), states


def test_a_job_with_a_long_running_sidecar_fails_when_training_does(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    job = with_sidecar("shipper-bad", [{"name": "SEQTRAIN_FAULT_SETUP_ERROR", "value": "no dataset here"}])
    job["spec"]["faultTolerance"]["maxRestarts"] = 0
    testbed.apply(job, ns)
    failed = wait_phase(testbed, seqtrain_operator, ns, "shipper-bad", "Failed")
    assert "no dataset here" in failed.get("message", ""), failed
    assert job_status(testbed, ns, "shipper-bad").get("restarts", 0) == 0
