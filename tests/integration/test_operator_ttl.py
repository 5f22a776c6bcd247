"""spec.ttlSecondsAfterFinished through the real kopf operator: a finished job and its children are deleted."""

from __future__ import annotations

import pytest
from k8sfake import wait_for
from operator_harness import (
    OperatorThread,
    events,
    fake_cluster,
    fast_config,
    job_doc,
    pods_of,
    submit,
    wait_phase,
    wait_pods,
)

pytestmark = pytest.mark.timeout(120)


def test_finished_job_is_deleted_with_its_children_after_the_ttl(tmp_path):
    with fake_cluster(tmp_path) as (_, cluster):
        for i in range(2):
            cluster.add_node(f"worker-{i}", cpu="4", memory="8Gi")
        op = OperatorThread(fast_config()).start()
        try:
            ns = "ttl"
            submit(cluster, job_doc("keep", ns))
            submit(cluster, job_doc("gone", ns, ttlSecondsAfterFinished=2))
            for name in ("keep", "gone"):
                wait_pods(cluster, ns, name, 1, 2)
                cluster.run_pods(ns, f"seqtrain.dev/job={name}")
                wait_phase(cluster, ns, name, "Running")
                cluster.finish_pods(ns, f"seqtrain.dev/job={name}", exit_code=0)
                wait_phase(cluster, ns, name, "Succeeded")
            wait_for(lambda: [j["metadata"]["name"] for j in cluster.list("seqtrain.dev", "seqtrainjobs", ns)]
                     == ["keep"], timeout=30, what="the job with a TTL deleted, the other kept")
            assert pods_of(cluster, ns, "gone") == []
            assert [c["metadata"]["name"] for c in cluster.list("", "configmaps", ns)] == ["keep-config-1"]
            assert [s["metadata"]["name"] for s in cluster.list("", "services", ns)] == ["keep"]
            assert len(pods_of(cluster, ns, "keep")) == 2
            wait_for(lambda: "TTLExpired" in {r for r, _ in events(cluster, ns)}, timeout=10, what="TTLExpired event")
        finally:
            op.stop()
