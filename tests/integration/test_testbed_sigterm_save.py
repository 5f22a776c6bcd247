"""Checkpoint-aware preemption on the real control plane (scripts/testbed.sh): a preemption notice (SIGTERM) makes
the trainer save the step it reached, and the restarted gang resumes from there instead of from scratch.

examples/k8s-cpu.yaml (2 replicas x 1 rank, PVC checkpoints) with a checkpoint interval longer than the run, so no
periodic save ever happens before the end. Mid-run, replica 1's pod is evicted through the Eviction API (what a
drain or a preemption does): the apiserver marks it DisruptionTarget and deletes it gracefully, the node agent sends
SIGTERM with the pod's grace period, the ranks agree to stop at the end of the step and save it. The operator
restarts the gang as a disruption (charged to no budget); the new attempt resumes from that checkpoint: its first
step in metrics.jsonl is the next one, status.lastCheckpoint and status.workAtRisk count from it, every step is
trained once.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest
import yaml

from seqtrain.checkpoint.discovery import published
from testbed.fixtures import ROOT, TB, Operator, Testbed, wait

pytestmark = pytest.mark.slow

# The first gang holds after step HOLD until SIGTERM (seqtrain.runtime.faults; the restarted gang runs clean), so the
# eviction lands mid-run at a known step however fast this machine trains; INTERVAL > STEPS: no periodic save before
# the end, so a checkpoint before it is the SIGTERM's.
STEPS, INTERVAL, HOLD = 60, 1000, 13
RUN_TIMEOUT = 900  # seconds for both attempts of a 2-rank CPU run on a loaded 2-core machine; a deadline only
NAME = "preempted"


def job() -> dict[str, Any]:
    out = yaml.safe_load((ROOT / "examples" / "k8s-cpu.yaml").read_text())
    out["metadata"]["name"] = NAME
    out["spec"]["training"]["steps"] = STEPS
    out["spec"]["checkpoint"]["intervalSteps"] = INTERVAL
    out["spec"]["scheduling"]["nodeSelector"] = {"seqtrain.dev/testbed-agent": "true"}
    hold = [{"name": "SEQTRAIN_FAULT_HOLD_AT_STEP", "value": f"{HOLD}:900"},
            {"name": "SEQTRAIN_FAULT_ATTEMPT", "value": "1"}]
    out["spec"]["podTemplate"] = {"spec": {"containers": [{"name": "trainer", "env": hold}]}}
    return out


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    return testbed.checkpoint_namespace("sigterm")


def status(tb: Testbed, ns: str) -> dict[str, Any]:
    return ((tb.get("seqtrainjob", NAME, ns) or {}).get("status")) or {}


def records(ns: str) -> list[dict[str, Any]]:
    path = TB / "volumes" / ns / NAME / "metrics.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def checkpoints(ns: str) -> list[int]:
    return [step for step, _ in published(str(TB / "volumes" / ns / NAME / "checkpoints"))]


def live_pods(tb: Testbed, ns: str) -> dict[tuple[int, int], dict[str, Any]]:
    """(attempt, replica) -> pod of the job, not being deleted."""
    items = tb.get("pods", namespace=ns, selector=f"seqtrain.dev/job={NAME}") or []
    return {(int(p["metadata"]["labels"]["seqtrain.dev/attempt"]), int(p["metadata"]["labels"]["seqtrain.dev/replica"])):
            p for p in items if not p["metadata"].get("deletionTimestamp")}


def evict(tb: Testbed, pod: dict[str, Any]) -> None:
    """POST pods/<name>/eviction, as `kubectl drain` and the cluster autoscaler do."""
    meta = pod["metadata"]
    body = {"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]}}
    tb.kubectl("create", "--raw", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/eviction", "-f", "-",
               input=json.dumps(body))


def _t(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.mark.timeout(RUN_TIMEOUT + 300)
def test_an_evicted_replica_saves_on_sigterm_and_the_gang_resumes_from_that_step(
        testbed: Testbed, seqtrain_operator: Operator, ns: str) -> None:
    def not_failed() -> dict[str, Any]:
        st = status(testbed, ns)
        if st.get("phase") == "Failed":
            pytest.fail(f"{NAME} failed: {st.get('message')}\n{seqtrain_operator.logs()}", pytrace=False)
        return st

    try:
        testbed.apply(job(), ns)
        wait(f"{NAME} holding at step {HOLD}", lambda: any(r["step"] >= HOLD for r in records(ns)), RUN_TIMEOUT,
             interval=0.5)
        before = live_pods(testbed, ns)
        victim = before[(1, 1)]
        assert checkpoints(ns) == [], checkpoints(ns)  # no periodic save yet: a restart now would start from 0
        grace = victim["spec"]["terminationGracePeriodSeconds"]
        env = {e["name"]: e.get("value") for e in victim["spec"]["containers"][0]["env"]}
        assert 0 < float(env["SEQTRAIN_TERM_GRACE_SECONDS"]) < grace  # the trainer's budget, within the pod's
        evict(testbed, victim)

        done = wait(f"{NAME} Succeeded", lambda: (s := not_failed()).get("phase") == "Succeeded" and s, RUN_TIMEOUT,
                    interval=2)
        # The node agent sent SIGTERM with the pod's grace period; the ranks saved the step they had reached.
        name = victim["metadata"]["name"]
        assert f"pod {ns}/{name}: SIGTERM (grace {grace}s)" in (TB / "logs" / "node-agent.log").read_text(), name
        assert checkpoints(ns) == [HOLD, STEPS], checkpoints(ns)  # the SIGTERM's and the end's, nothing periodic
        # A disruption, charged to no budget; the new attempt resumed from the SIGTERM checkpoint: the highest step
        # trained before it is that checkpoint's, so none was redone.
        assert (done["attempt"], done["restarts"], done.get("infraRestarts", 0)) == (2, 0, 0), done
        assert (done["progress"]["attempt"], done["progress"]["stepReachedBefore"]) == (2, HOLD), done["progress"]
        events = [e for e in testbed.get("events", namespace=ns) or [] if e["involvedObject"].get("name") == NAME]
        assert any(e["reason"] == "Evicted" and "not counted" in e["message"] for e in events), events
        # metrics.jsonl: the old gang's last step is the checkpoint's, the new attempt's first step the next one,
        # every step once.
        began = _t(done["progress"]["trainingStartedAt"])
        recs = records(ns)
        old, new = [r["step"] for r in recs if r["time"] < began], [r["step"] for r in recs if r["time"] >= began]
        assert (max(old), min(new)) == (HOLD, HOLD + 1), (old, new)
        assert [r["step"] for r in recs] == list(range(1, STEPS + 1)), recs
        # and the status says so: no step redone, no time charged as recomputed (the eviction's pass counted all 13
        # from "no checkpoint"; the re-creation recounts them from the checkpoint it resumes from)
        assert done["stepsLost"] == [0], done["stepsLost"]
        assert done["lostSeconds"]["recomputed"] == 0, done["lostSeconds"]
        print(json.dumps({k: done.get(k) for k in ("message", "stepsLost", "lostSeconds", "workAtRisk",
                                                    "lastCheckpoint")}))
        print(json.dumps([(e["reason"], e["message"]) for e in events]))
    finally:
        testbed.kubectl("delete", "stj", NAME, "-n", ns, "--ignore-not-found", "--wait=true", "--timeout=180s",
                        timeout=240)
