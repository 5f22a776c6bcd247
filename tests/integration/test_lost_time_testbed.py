"""Where the time went, on the real control plane (scripts/testbed.sh): a 2-replica CPU job (examples/k8s-cpu.yaml)
on the node agent's nodes, with the chart installed and the operator running as its ServiceAccount. The custom
resource's status.lostSeconds has queueing and start-up filled and adds up with productiveSeconds to the wall
time from the job's creation; the operator's /metrics exports the same figures per job."""

from __future__ import annotations

import urllib.request
from datetime import datetime
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_testbed_e2e import cpu_job, wait_phase

from testbed.fixtures import Operator, Testbed, wait

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    return testbed.checkpoint_namespace("lost")


def _t(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def scrape(op: Operator, ns: str, job: str) -> dict[str, Any]:
    """The operator's per-job series of one job: name (and reason/kind) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("namespace") == ns and s.labels.get("job") == job:
                key = s.name + "".join(f"/{s.labels[k]}" for k in ("reason", "kind") if k in s.labels)
                out[key] = s.value
    return out


def test_lost_time_is_on_the_custom_resource_and_in_the_operators_metrics(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    job = cpu_job("lost-time")
    testbed.apply(job, ns)
    running = wait("lost-time trained a step with its status written",
                   lambda: (st := testbed.get("seqtrainjob", "lost-time", ns) or {}).get("status", {})
                   .get("progress", {}).get("step", 0) > 0 and st, 900, 1)
    lost = running["status"]["lostSeconds"]
    # created until the operator admitted and placed the gang; pods created until the trainer's first step
    assert lost["queueing"] > 0 and lost["startup"] > 0, running["status"]
    assert lost["restart"] == 0 and lost["recomputed"] == 0

    done = wait_phase(testbed, seqtrain_operator, ns, "lost-time", "Succeeded")
    created = _t(running["metadata"]["creationTimestamp"])
    lost = done["lostSeconds"]
    wall = (_t(done["completionTime"]) - created).total_seconds()
    assert done["productiveSeconds"] > 0 and lost["checkpointStall"] > 0  # a checkpoint every 10 steps
    assert done["productiveSeconds"] + sum(lost.values()) == pytest.approx(wall, abs=0.02)
    assert done["goodput"] == pytest.approx(done["productiveSeconds"] / wall, abs=1e-3)

    # the operator's /metrics: the figures of its last pass, which for a finished job are the status's
    def exported() -> dict[str, Any] | None:
        m = scrape(seqtrain_operator, ns, "lost-time")
        return m if m.get("seqtrain_job_step") == done["progress"]["step"] else None
    m = wait("the operator's metrics of lost-time at its last step", exported, 120, 1)
    for reason in ("queueing", "startup", "checkpointStall", "restart", "recomputed", "suspended"):
        assert m[f"seqtrain_job_lost_seconds/{reason}"] == pytest.approx(lost[reason], abs=1e-3), reason
    assert m["seqtrain_job_goodput_ratio"] == pytest.approx(done["goodput"])
    assert m["seqtrain_job_productive_seconds"] == pytest.approx(done["productiveSeconds"])
    assert m["seqtrain_job_restarts/user"] == 0 and m["seqtrain_job_restarts/infrastructure"] == 0
    assert m["seqtrain_job_total_steps"] == done["progress"]["totalSteps"]
