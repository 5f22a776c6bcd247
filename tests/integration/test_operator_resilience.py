"""The operator under stress: restarted mid-job, API conflicts / 500s / timeouts, progress over HTTP, webhook."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from k8sfake import wait_for
from operator_harness import (
    OperatorThread,
    events,
    fake_cluster,
    fast_config,
    job_doc,
    pods_of,
    status,
    submit,
    wait_phase,
    wait_pods,
)

pytestmark = pytest.mark.timeout(120)


def test_operator_restart_mid_job_loses_nothing_duplicates_nothing(tmp_path):
    with fake_cluster(tmp_path) as (fake, cluster):
        cluster.add_node("w", cpu="8", memory="16Gi")
        op = OperatorThread(fast_config()).start()
        submit(cluster, job_doc("j", "ns"))
        wait_pods(cluster, "ns", "j", 1, 2)
        cluster.run_pods("ns", "seqtrain.dev/job=j")
        wait_phase(cluster, "ns", "j", "Running")
        cluster.set_pod("ns", "j-1-0", "Failed", exit_code=1)
        wait_pods(cluster, "ns", "j", 2, 2)
        before = status(cluster, "ns", "j")
        op.stop()

        # while no operator runs, the new gang starts and a replica fails
        cluster.run_pods("ns", "seqtrain.dev/attempt=2")
        cluster.set_pod("ns", "j-2-1", "Failed", exit_code=137, container_reason="OOMKilled")
        op2 = OperatorThread(fast_config()).start()
        try:
            wait_pods(cluster, "ns", "j", 3, 2)
            st = status(cluster, "ns", "j")
            assert st["restarts"] == before["restarts"] + 1 == 2  # counted once, from the persisted status
            assert st["attempt"] == 3
            wait_for(lambda: "OOMKilled" in {r for r, _ in events(cluster, "ns")}, what="OOMKilled event")
            cluster.run_pods("ns", "seqtrain.dev/attempt=3")
            wait_phase(cluster, "ns", "j", "Running")
            # a restart with nothing to do creates nothing
            op2.stop()
            op2 = OperatorThread(fast_config()).start()
            wait_for(lambda: fake.count("GET", r"/namespaces/ns/seqtrainjobs/j$") > 0, what="reconciled again")
            cluster.finish_pods("ns", "seqtrain.dev/attempt=3")
            wait_phase(cluster, "ns", "j", "Succeeded")
        finally:
            op2.stop()
        assert fake.count("POST", r"/namespaces/ns/pods$", status=201) == 6  # 3 attempts x 2, never more
        assert fake.count("POST", r"/namespaces/ns/pods$", status=409) == 0


def test_conflicts_500s_and_timeouts_are_retried_without_duplicates(tmp_path):
    with fake_cluster(tmp_path) as (fake, cluster):
        cluster.add_node("w", cpu="8", memory="16Gi")
        fake.inject("POST", r"/namespaces/f/pods$", status=500, times=3)
        fake.inject("PATCH", r"/seqtrainjobs/j/status$", status=409, times=2)
        fake.inject("GET", r"/namespaces/f/seqtrainjobs/j$", status=503, times=2)
        op = OperatorThread(fast_config()).start()
        try:
            from seqtrain_operator.k8s import handlers

            handlers.STATE.kube.timeout = 2.0  # make the hung request below time out quickly
            hung = fake.inject("GET", r"/api/v1/nodes$", delay=20.0, times=1)  # longer than the client waits
            submit(cluster, job_doc("j", "f"))
            pods = wait_pods(cluster, "f", "j", 1, 2, timeout=40)
            assert sorted(p["metadata"]["name"] for p in pods) == ["j-1-0", "j-1-1"]
            cluster.run_pods("f", "seqtrain.dev/job=j")
            st = wait_phase(cluster, "f", "j", "Running")
            assert st["attempt"] == 1 and st["restarts"] == 0
            assert hung.hits == 1
        finally:
            op.stop()
        assert fake.count("POST", r"/namespaces/f/pods$", status=500) == 3
        assert fake.count("POST", r"/namespaces/f/pods$", status=201) == 2  # retried, never doubled
        assert fake.count("PATCH", r"/seqtrainjobs/j/status$", status=409) == 2
        assert len(pods_of(cluster, "f", "j")) == 2


class _Progress(BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self):  # noqa: N802
        assert self.path == "/progress"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_progress_polled_from_rank0_and_goodput(tmp_path):
    _Progress.body = json.dumps({"step": 7, "totalSteps": 10, "loss": 2.5, "tokensPerSecond": 1234.5,
                                 "updatedAt": "2026-11-22T00:00:00Z",
                                 "lastCheckpoint": {"step": 5, "path": "/checkpoints/j/checkpoints/step-5"}}).encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Progress)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with fake_cluster(tmp_path) as (_, cluster):
            cluster.add_node("w", cpu="8", memory="16Gi")
            op = OperatorThread(fast_config(progress_port=server.server_address[1])).start()
            try:
                submit(cluster, job_doc("j", "p", replicas=1))
                pod = wait_pods(cluster, "p", "j", 1, 1)[0]
                cluster.bind("p", pod["metadata"]["name"])
                cluster.set_pod("p", pod["metadata"]["name"], "Running", pod_ip="127.0.0.1")
                st = wait_for(lambda: (s := status(cluster, "p", "j")).get("progress", {}).get("step") == 7 and s,
                              what="progress in status")
                assert st["progress"]["loss"] == 2.5 and st["progress"]["tokensPerSecond"] == 1234.5
                assert st["lastCheckpoint"]["step"] == 5
                assert 0.0 <= st["goodput"] <= 1.0
            finally:
                op.stop()
    finally:
        server.shutdown()


def test_admission_webhook_uses_spec_validation(tmp_path):
    with fake_cluster(tmp_path):
        op = OperatorThread(fast_config()).start()
        try:
            def review(spec):
                obj = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob",
                       "metadata": {"name": "w", "namespace": "x"}, "spec": spec}
                req = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                    "uid": "u1", "kind": {"group": "seqtrain.dev", "version": "v1alpha1", "kind": "SeqTrainJob"},
                    "resource": {"group": "seqtrain.dev", "version": "v1alpha1", "resource": "seqtrainjobs"},
                    "operation": "CREATE", "object": obj, "userInfo": {"username": "u"}, "namespace": "x",
                    "name": "w"}}
                data = json.dumps(req).encode()
                url = f"http://127.0.0.1:{op.webhook_port}/validate-seqtrainjob"
                r = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(r, timeout=10) as resp:
                    return json.load(resp)["response"]

            ok = wait_for(lambda: _try(review, {"replicas": 1}), what="webhook up")
            assert ok["allowed"] is True
            bad = review({"replicas": 2, "training": {"globalBatchSize": 3, "microBatchSize": 1},
                          "faultTolerance": {"maxRestarts": -1}})
            assert bad["allowed"] is False and bad["status"]["code"] == 422
            assert "spec.faultTolerance.maxRestarts" in bad["status"]["message"]
        finally:
            op.stop()


def _try(fn, *args):
    try:
        return fn(*args)
    except OSError:
        return None
