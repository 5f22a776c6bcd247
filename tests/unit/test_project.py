"""What the operator's caches keep of a pod (k8s/cache/project.py): what its readers need, shared where it repeats."""

from __future__ import annotations

import json

from seqtrain_operator.k8s.cache import project
from seqtrain_operator.k8s.pods.observe import _disruption, _placed_at, awaiting_scheduler


def pod(name: str) -> dict:
    # As a watch delivers it: each event decoded on its own (no string shared with another pod's).
    return json.loads(json.dumps({
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "resourceVersion": "7",
                     "labels": {"seqtrain.dev/job": "j", "seqtrain.dev/attempt": "1", "seqtrain.dev/replica": "0"},
                     "managedFields": [{"manager": "kubectl"}]},
        "spec": {"nodeName": "n1", "containers": [{"name": "trainer", "image": "x", "env": [{"name": "A"}],
                                                   "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}]},
        "status": {"phase": "Running", "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-11-26T10:00:00Z"},
            {"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-26T10:00:09Z"},
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-26T10:00:01Z"},
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
             "lastTransitionTime": "2026-11-26T10:00:30Z"}],
            "containerStatuses": [{"name": "trainer", "image": "x", "imageID": "sha256:0",
                                   "state": {"running": {"startedAt": "2026-11-26T10:00:05Z"}}}]}}))


def test_a_projection_keeps_what_its_readers_read_and_shares_repeated_strings() -> None:
    a, b = project.pod(pod("p-0")), project.pod(pod("p-1"))
    assert [c["type"] for c in a["status"]["conditions"]] == ["PodScheduled", "DisruptionTarget"]
    assert "managedFields" not in a["metadata"] and "env" not in a["spec"]["containers"][0]
    assert _placed_at(a) == "2026-11-26T10:00:01Z" and _disruption(a) == "Evicted" and not awaiting_scheduler(a)
    # the same label key, value and quantity are one object across pods, not one per watch event
    ka, kb = next(iter(a["metadata"]["labels"])), next(iter(b["metadata"]["labels"]))
    assert ka == kb and ka is kb
    qa = a["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    assert qa is b["spec"]["containers"][0]["resources"]["requests"]["cpu"]


def test_a_jobs_copy_leaves_out_what_no_pass_reads_and_is_its_own() -> None:
    live = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob",
            "metadata": {"name": "j", "namespace": "ml", "uid": "u", "resourceVersion": "9", "generation": 2,
                         "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {"f:replicas": {}}}}],
                         "annotations": {project._LAST_APPLIED: '{"spec": {}}', "seqtrain.dev/last-handled": "x"}},
            "spec": {"replicas": 2, "model": {"arch": "gpt"}}, "status": {"phase": "Running", "attempt": 1}}
    job = project.job(live)
    assert "managedFields" not in job["metadata"]
    assert job["metadata"]["annotations"] == {"seqtrain.dev/last-handled": "x"}  # kopf's, which a pass reads
    assert {k: job["metadata"][k] for k in ("name", "uid", "resourceVersion", "generation")} == {
        "name": "j", "uid": "u", "resourceVersion": "9", "generation": 2}
    assert job["spec"] == live["spec"] and job["status"] == live["status"]
    job["status"]["phase"] = "Failed"
    job["spec"]["model"]["arch"] = "lstm"
    assert live["status"]["phase"] == "Running" and live["spec"]["model"]["arch"] == "gpt"  # the live body is untouched
    assert "managedFields" in live["metadata"]


def test_a_reservation_kept_as_a_projection_takes_what_the_pod_will_take() -> None:
    """Admission reserves placed pods as projections (reconcile._placed_pods): the node and the requests the capacity
    ledger charges are those of the manifest that is created, GPUs, init containers and overhead included."""
    from seqtrain.spec import SeqTrainJob
    from seqtrain_operator.k8s.owner import Owner
    from seqtrain_operator.k8s.pods import manifests as m
    from seqtrain_operator.planner.inventory import node_of, pod_requests

    job = SeqTrainJob.model_validate({
        "apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "gpt", "namespace": "ml"},
        "spec": {"replicas": 2, "resources": {"gpus": 8, "cpu": "32", "memory": "256Gi"}}})
    full = m.build_pod(job, Owner(name="gpt", namespace="ml", uid="u-1"), 1, 1, m.Settings(), "gpu-node-7")
    kept = project.pod(full)
    assert node_of(kept) == node_of(full) == "gpu-node-7"
    assert pod_requests(kept) == pod_requests(full) and pod_requests(kept)
    assert kept["metadata"]["labels"] == full["metadata"]["labels"]  # whose reservation it is (busy.outstanding)
    assert len(json.dumps(kept)) < len(json.dumps(full)) / 2
