"""The operator's caches keep trimmed projections of pods and nodes (k8s/cache/project.py), and admission reads free
capacity from a ledger updated one pod event at a time (k8s/capacity/ledger.py): both must see exactly what the whole
objects and a full inventory show."""

from __future__ import annotations

import copy
import json
import random

import pytest
from test_admission_lock import _job
from test_k8s_observe import CASES, NOW, node
from test_placement import job_pod, k8s_node

from seqtrain.spec import parse_job
from seqtrain_operator.k8s.cache import project
from seqtrain_operator.k8s.capacity.busy import BusyPods
from seqtrain_operator.k8s.capacity.ledger import Ledger
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.pods.observe import observe_replicas
from seqtrain_operator.planner.inventory import inventory


def _as_served(pod: dict) -> dict:
    """A pod as the apiserver serves it: our manifest plus what the API adds (managedFields, uid, a status)."""
    p = copy.deepcopy(pod)
    p["metadata"].update(uid="u-" + p["metadata"]["name"], resourceVersion="7", managedFields=[
        {"manager": "seqtrain", "operation": "Update", "fieldsV1": {"f:spec": {"f:containers": {"x" * 200: {}}}}}])
    p["status"] = {"phase": "Running", "podIP": "10.0.0.9", "hostIP": "10.1.0.1", "qosClass": "Guaranteed",
                   "conditions": [{"type": "Ready", "status": "True", "lastProbeTime": None,
                                   "lastTransitionTime": "2026-11-22T11:00:00Z"}],
                   "containerStatuses": [{"name": "trainer", "image": "seqtrain:1", "imageID": "sha256:" + "f" * 64,
                                          "containerID": "containerd://" + "e" * 64, "ready": True,
                                          "restartCount": 0, "state": {"running": {"startedAt": "2026-11-22T11:00:01Z"}},
                                          "lastState": {}}]}
    return p


def _gang_pods() -> list[dict]:
    job = parse_job(_job("big"))
    gang = m.build_gang(job.with_replicas(job.spec.replicas), Owner("big", "ml", "uid-big"), 3, m.Settings(), None)
    return [_as_served(p) for p in gang.pods]


def test_a_projected_pod_is_observed_exactly_as_the_whole_pod_and_holds_no_env_or_managed_fields():
    nodes = [node("n1"), node("blip", "False", "2026-11-22T11:59:50Z"), node("down", "False", "2026-11-22T11:50:00Z")]
    pods = [c[1] for c in CASES] + _gang_pods()
    projected = [project.pod(p) for p in pods]
    assert observe_replicas(projected, [project.node(n) for n in nodes], NOW) == observe_replicas(pods, nodes, NOW)
    served = _gang_pods()[0]
    trimmed = project.pod(served)
    assert "managedFields" not in trimmed["metadata"] and "env" not in trimmed["spec"]["containers"][0]
    assert trimmed["metadata"]["labels"] == served["metadata"]["labels"]
    assert len(json.dumps(trimmed)) * 3 < len(json.dumps(served))


def test_projected_pods_and_nodes_give_the_same_inventory():
    nodes = [k8s_node("g1", gpus=8), k8s_node("g2", gpus=8, taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}],
                                              pods=110)]
    nodes[0]["status"]["images"] = [{"names": ["x" * 100], "sizeBytes": 1}] * 50
    pods = [job_pod("a", node="g1", gpus=4), job_pod("b", pinned="g2", gpus=2), job_pod("c", nominated="g1", gpus=1),
            job_pod("d", gpus=8), job_pod("e", node="g2", gpus=1, phase="Succeeded")]
    assert inventory([project.node(n) for n in nodes], [project.pod(p) for p in pods]) == inventory(nodes, pods)
    assert "images" not in project.node(nodes[0])["status"]


def _pod(i: int, job: str | None, node_name: str | None, phase: str, cpu: int) -> dict:
    p = job_pod(f"p{i}", node=node_name, gpus=0, phase=phase, cpu=f"{cpu}m")
    p["metadata"].update(name=f"p{i}", namespace="ml", labels={m.LABEL_JOB: job} if job else {})
    return p


@pytest.mark.parametrize("seed", range(5))
def test_the_ledger_after_any_sequence_of_pod_events_equals_a_full_inventory(seed: int) -> None:
    rnd = random.Random(seed)
    nodes = [k8s_node(f"n{i}", gpus=0, cpu="16", pods=110) for i in range(4)]
    ledger, live = Ledger(), {}
    for step in range(300):
        i = rnd.randrange(40)
        if i in live and rnd.random() < 0.3:
            del live[i]
            ledger.remove(("ml", f"p{i}"))
        else:
            pod = _pod(i, rnd.choice([None, "a", "b"]), rnd.choice([None, "n0", "n1", "n2", "n3"]),
                       rnd.choice(["Pending", "Running", "Succeeded", "Failed"]), rnd.randrange(1, 2000))
            live[i] = pod
            ledger.update(project.pod(pod))
        if step % 50 == 0:
            assert ledger.free(nodes) == inventory(nodes, live.values())
    assert ledger.free(nodes) == inventory(nodes, live.values())
    # a job being admitted does not count its own (going) pods
    others = [p for p in live.values() if p["metadata"]["labels"].get(m.LABEL_JOB) != "a"]
    assert ledger.free(nodes, exclude_job=("ml", "a")) == inventory(nodes, others)


def test_a_reservation_counts_until_the_ledger_shows_its_pod() -> None:
    nodes = [k8s_node("n0", gpus=0, cpu="4", pods=110)]
    ledger, busy = Ledger(), BusyPods()
    planned = _pod(1, "a", None, "Pending", 3000)
    planned["spec"]["affinity"] = job_pod("x", pinned="n0")["spec"]["affinity"]
    keys = busy.reserve([planned])
    busy.created(keys)
    assert ledger.free(nodes, busy.outstanding(ledger.seen, ("ml", "b")), ("ml", "b"))[0].cpu_millis == 1000
    # the same, from the requests parsed once per reservation (what the operator reads)
    for _ in range(2):
        use = busy.outstanding_use(ledger.seen, ("ml", "b"))
        assert ledger.free(nodes, exclude_job=("ml", "b"), reserved_use=use)[0].cpu_millis == 1000
    ledger.update(project.pod(planned))  # the watch shows it: counted once, by the ledger
    assert busy.outstanding(ledger.seen, ("ml", "b")) == []
    assert busy.outstanding_use(ledger.seen, ("ml", "b")) == []
    assert ledger.free(nodes, [], ("ml", "b"))[0].cpu_millis == 1000
