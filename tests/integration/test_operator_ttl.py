"""spec.ttlSecondsAfterFinished through the real kopf operator on the test control plane: a finished job is
deleted after its TTL and the garbage collector takes its children; a job without a TTL stays."""

from __future__ import annotations

import pytest
from operator_harness import (
    OperatorThread,
    add_node,
    bed,
    fast_config,
    finish_pods,
    job_doc,
    jobs,
    namespace,
    pods_of,
    reasons,
    submit,
    teardown,
    wait_for,
    wait_phase,
    wait_running,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def env(seqtrain_operator, tmp_path_factory):
    gen = bed(seqtrain_operator, tmp_path_factory.mktemp("kube"))
    b = next(gen)
    op = OperatorThread(fast_config(), b.webhook()).start()
    pools: list[str] = []
    try:
        yield b, pools
    finally:
        try:
            teardown(b.cp, pools)
        finally:
            op.stop()
            gen.close()


def test_finished_job_is_deleted_with_its_children_after_the_ttl(env):
    b, pools = env
    cp = b.cp
    ns = namespace(cp, "op-ttl")
    pools.append(ns)
    for i in range(2):
        add_node(cp, f"{ns}-{i}", pool=ns, cpu="4", memory="8Gi")
    submit(cp, job_doc("keep", ns))
    submit(cp, job_doc("gone", ns, ttlSecondsAfterFinished=2))
    for name in ("keep", "gone"):
        wait_running(cp, ns, name, 1, 2)
        wait_phase(cp, ns, name, "Running")
        finish_pods(cp, ns, f"seqtrain.dev/job={name}", exit_code=0)
        wait_phase(cp, ns, name, "Succeeded")
    wait_for(lambda: [j["metadata"]["name"] for j in jobs(cp, ns)] == ["keep"], timeout=60,
             what="the job with a TTL deleted, the other kept")
    # the garbage collector deletes what the job owned (ownerReferences), in its own time
    wait_for(lambda: pods_of(cp, ns, "gone") == [], timeout=60, what="the deleted job's pods gone")
    wait_for(lambda: [c.metadata.name for c in cp.core.list_namespaced_config_map(ns).items
                      if c.metadata.name.startswith(("keep", "gone"))] == ["keep-config-1"], timeout=60,
             what="only the kept job's ConfigMap left")
    wait_for(lambda: [s.metadata.name for s in cp.core.list_namespaced_service(ns).items] == ["keep"], timeout=60,
             what="only the kept job's Service left")
    assert len(pods_of(cp, ns, "keep")) == 2
    wait_for(lambda: "TTLExpired" in reasons(cp, ns), timeout=30, what="TTLExpired event")
