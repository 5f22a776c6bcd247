"""What the operator's caches keep of a pod (k8s/project.py): what its readers need, shared where it repeats."""

from __future__ import annotations

import json

from seqtrain_operator.k8s import project
from seqtrain_operator.k8s.observe import _disruption, _placed_at, awaiting_scheduler


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
