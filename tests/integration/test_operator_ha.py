"""Two operator replicas (kopf peering, as the chart deploys them) against one fake API server: one acts, the
other stands by, and takes over when the active one is killed, without duplicating pods or restarts.

Each replica is a separate process started through the real CLI (`seqtrain operator --peering=seqtrain ...`,
random priority), with its own kubeconfig token so the fake can attribute every request to a replica, and its own
peering identity (POD_ID, as the chart sets it). The active replica is killed with SIGKILL: no clean peering exit,
so the stand-by must notice the stale keep-alive itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8sfake import Cluster, FakeKubernetes, wait_for
from operator_harness import fake_cluster, job_doc, pods_of, status, submit, wait_phase, wait_pods

ROOT = Path(__file__).resolve().parents[2]
PEERING_CRDS = ROOT / "charts" / "seqtrain" / "crds" / "kopf-peering.yaml"
PEERING = ("kopf.dev", "clusterkopfpeerings")
LIFETIME = 3  # --peering-lifetime: how stale the killed replica's keep-alive must get before the other acts

pytestmark = pytest.mark.timeout(180)


def install_peering(cluster: Cluster, name: str = "seqtrain") -> None:
    """The chart's peering CRDs and its ClusterKopfPeering object."""
    for doc in yaml.safe_load_all(PEERING_CRDS.read_text()):
        cluster.install_crd(doc)
    cluster.store.create(cluster.res(*PEERING), None,
                         {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}})


def peers(cluster: Cluster) -> dict[str, Any]:
    return cluster.get(*PEERING, None, "seqtrain").get("status") or {}


class Replica:
    """One `seqtrain operator` process; its log goes to a file the test reads."""

    def __init__(self, fake: FakeKubernetes, tmp: Path, ident: str):
        self.ident = ident
        self.log = tmp / f"{ident}.log"
        env = {**os.environ, "KUBECONFIG": fake.kubeconfig(str(tmp / f"{ident}.kubeconfig"), token=ident),
               "POD_ID": ident, "OMP_NUM_THREADS": "1", "SEQTRAIN_CHECK_PATHS": "0",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "trainer"), str(ROOT / "operator")])}
        args = [sys.executable, "-m", "seqtrain_operator.cli", "operator", "--all-namespaces", "--peering=seqtrain",
                f"--peering-lifetime={LIFETIME}", "--progress-port=0", "--node-lost-grace=0"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def paused(log: str) -> bool | None:
    """Whether kopf's last word in this replica's log was pausing (True) or resuming (False); None: neither yet."""
    pause, resume = log.rfind("Pausing operations"), log.rfind("Resuming operations")
    return None if pause == resume == -1 else pause > resume


def writes(fake: FakeKubernetes, user: str, since: int = 0) -> list[str]:
    """What `user` changed in the cluster, leaving out its peering keep-alives."""
    return [f"{r.method} {r.path}" for r in fake.requests[since:]
            if r.user == user and r.method in ("POST", "PUT", "PATCH", "DELETE") and "/kopf.dev/" not in r.path]


def pod_creates(fake: FakeKubernetes, namespace: str) -> Counter[tuple[str, int]]:
    """(pod name, HTTP status) of every pod create the fake answered."""
    return Counter((r.body["metadata"]["name"], r.status) for r in list(fake.requests)
                   if r.method == "POST" and r.path == f"/api/v1/namespaces/{namespace}/pods")


def test_fake_serves_kopf_peering(tmp_path):
    """The fake serves the chart's peering CRDs the way kopf uses them: discovery, merge-patched keep-alives (null
    removes a peer), a watch, and it records which client (token) sent each request."""
    import urllib.request

    with FakeKubernetes() as fake:
        cluster = Cluster(fake)
        install_peering(cluster)

        def call(method: str, path: str, body: Any = None, token: str = "a") -> Any:
            import json

            req = urllib.request.Request(fake.url + path, method=method, data=None if body is None else
                                         json.dumps(body).encode(), headers={
                                             "Authorization": f"Bearer {token}",
                                             "Content-Type": "application/merge-patch+json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.load(resp)

        kinds = {r["name"]: r["namespaced"] for r in call("GET", "/apis/kopf.dev/v1")["resources"]}
        assert kinds == {"clusterkopfpeerings": False, "kopfpeerings": True}
        path = "/apis/kopf.dev/v1/clusterkopfpeerings/seqtrain"
        call("PATCH", path, {"status": {"op-a": {"priority": 5, "lifetime": 3}}}, token="a")
        call("PATCH", path, {"status": {"op-b": {"priority": 9, "lifetime": 3}}}, token="b")
        assert set(peers(cluster)) == {"op-a", "op-b"}
        call("PATCH", path, {"status": {"op-b": None}}, token="b")  # a clean exit removes the peer
        assert set(peers(cluster)) == {"op-a"}
        call("PUT", path, {**cluster.get(*PEERING, None, "seqtrain"), "status": {}}, token="a")
        assert peers(cluster) == {}
        assert fake.count("PATCH", "clusterkopfpeerings", user="a") == 1
        assert fake.count("PATCH", "clusterkopfpeerings", user="b") == 2
        ns = call("POST", "/apis/kopf.dev/v1/namespaces/team-a/kopfpeerings",
                  {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "seqtrain"}})
        assert ns["metadata"]["namespace"] == "team-a"


@pytest.mark.slow
def test_two_replicas_one_acts_and_the_other_takes_over(tmp_path):
    with fake_cluster(tmp_path) as (fake, cluster):
        install_peering(cluster)
        cluster.add_node("w", cpu="8", memory="16Gi")
        replicas = {r.ident: r for r in (Replica(fake, tmp_path, "op-a"), Replica(fake, tmp_path, "op-b"))}
        try:
            # Both keep-alives are in the peering object; one more keep-alive of the leader after that, so the
            # stand-by has seen the leader's. With a mandatory peering a replica starts paused and resumes only
            # when it sees no higher priority: the leader has resumed, the stand-by has not (or paused again).
            table = wait_for(lambda: len(p := peers(cluster)) == 2 and p, 60, what="both replicas in the peering")
            leader = max(table, key=lambda i: table[i]["priority"])
            standby = next(i for i in table if i != leader)
            assert table[leader]["priority"] != table[standby]["priority"]  # random priorities never tie
            seen = table[leader]["lastseen"]
            wait_for(lambda: peers(cluster)[leader]["lastseen"] != seen, 10 * LIFETIME, what="a fresh keep-alive")
            wait_for(lambda: paused(replicas[leader].text()) is False, 30, what=f"{leader} active")
            assert paused(replicas[standby].text()) is not False, replicas[standby].text()[-2000:]

            submit(cluster, job_doc("j", "ha"))
            wait_pods(cluster, "ha", "j", 1, 2)
            cluster.run_pods("ha", "seqtrain.dev/job=j")
            wait_phase(cluster, "ha", "j", "Running")
            cluster.set_pod("ha", "j-1-0", "Failed", exit_code=1)
            wait_pods(cluster, "ha", "j", 2, 2)
            st = wait_for(lambda: (s := status(cluster, "ha", "j")).get("attempt") == 2 and s, what="attempt 2")
            assert st["restarts"] == 1
            # Only the leader wrote anything: status, pods, finalizer, events. The stand-by only read and kept alive.
            assert any("/seqtrainjobs/j/status" in w for w in writes(fake, leader))
            assert writes(fake, standby) == []

            # The leader crashes (no clean exit from the peering); the stand-by takes over once its keep-alive is
            # stale and drives the job on: the failure below is the stand-by's to handle.
            before_kill = len(fake.requests)
            killed_at = time.monotonic()
            replicas[leader].kill()
            wait_for(lambda: paused(replicas[standby].text()) is False, 10 * LIFETIME + 30,
                     what=f"{standby} taking over")
            took = time.monotonic() - killed_at
            cluster.run_pods("ha", "seqtrain.dev/attempt=2")
            wait_phase(cluster, "ha", "j", "Running")
            cluster.set_pod("ha", "j-2-1", "Failed", exit_code=137, container_reason="OOMKilled")
            wait_pods(cluster, "ha", "j", 3, 2)
            st = wait_for(lambda: (s := status(cluster, "ha", "j")).get("attempt") == 3 and s, what="attempt 3")
            assert st["restarts"] == 2  # one more, counted once, on top of the leader's persisted count
            cluster.run_pods("ha", "seqtrain.dev/attempt=3")
            cluster.finish_pods("ha", "seqtrain.dev/attempt=3")
            st = wait_phase(cluster, "ha", "j", "Succeeded")
            assert st["restarts"] == 2 and st["attempt"] == 3
            assert any("/seqtrainjobs/j/status" in w for w in writes(fake, standby, before_kill))
            assert peers(cluster).keys() == {standby}  # the dead replica's entry was cleaned up
        finally:
            for r in replicas.values():
                r.stop()
            logs = {i: r.text() for i, r in replicas.items()}
        print(f"hand-over took {took:.1f}s with --peering-lifetime={LIFETIME}")

    # Exactly one gang per attempt: every pod name created once, never a 409 from a second actor.
    creates = pod_creates(fake, "ha")
    assert sorted(creates) == sorted((f"j-{a}-{r}", 201) for a in (1, 2, 3) for r in (0, 1)), creates
    assert set(creates.values()) == {1}
    assert len(pods_of(cluster, "ha", "j", 3)) == 2
    assert "Traceback" not in logs[standby], logs[standby][-3000:]


def test_peering_lifetime_too_short_is_refused(capsys):
    from seqtrain_operator.k8s.main import main

    with pytest.raises(SystemExit) as exc:
        main(["--peering=seqtrain", "--peering-lifetime=1"])
    assert exc.value.code == 2
    assert "--peering-lifetime 1: must be at least 2 seconds" in capsys.readouterr().err
