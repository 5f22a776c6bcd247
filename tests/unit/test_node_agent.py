"""The testbed's node agent against the kubelet behaviour Kubernetes documents.

The agent's API calls go to a small in-memory recorder (the agent's logic is under test here; the real apiserver
runs in tests/integration/test_testbed_e2e.py). The processes are real.
Kubelet references: "Pod Lifecycle" (phases, container states, termination with grace period), "Determine the
Reason for Pod Failure" (termination messages, FallbackToLogsOnError: 2048 bytes / 80 lines), "Define Dependent
Environment Variables" ($(VAR), $$), "Expose Pod Information to Containers Through Environment Variables".
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from testbed import node_agent as na

# ---- pure parts -------------------------------------------------------------------------------------------------


def test_env_as_the_kubelet_builds_it() -> None:
    pod = {"metadata": {"name": "p-0", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
           "spec": {"nodeName": "cpu-0"}}
    c = {"env": [
        {"name": "A", "value": "a"},
        {"name": "B", "value": "$(A)-b $$(A) $(UNDEFINED)"},  # earlier vars expand; $$ escapes; unknown stays
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
        {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "missing", "optional": True}}},
        {"name": "MASTER_ADDR", "value": "job-0.job.ns.svc"},
        {"name": "FULL", "value": "job-0.job.ns.svc.cluster.local"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "CK", "value": "/checkpoints/job/ck"},
        {"name": "URL", "value": "https://example.com/tmp"},  # not a path of the pod's: untouched
    ]}
    paths = na.PathMap({"/tmp": "/local/tmp", "/checkpoints": "/local/ck"})
    env = na.container_env(pod, c, lambda kind, name, key: {"k": "v"}.get(key), paths)
    assert env["B"] == "a-b $(A) $(UNDEFINED)"
    assert (env["POD"], env["NS"], env["IP"], env["NODE"], env["APP"]) == ("p-0", "ns", "127.0.0.1", "cpu-0", "x")
    assert env["CM"] == "v" and "OPT" not in env
    assert env["MASTER_ADDR"] == env["FULL"] == "127.0.0.1"
    assert env["HOME"] == "/local/tmp" and env["CK"] == "/local/ck/job/ck"
    assert env["URL"] == "https://example.com/tmp"


def test_a_missing_required_key_is_an_error_naming_it() -> None:
    c = {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}}]}
    with pytest.raises(ValueError, match="env X: secret s has no key token"):
        na.container_env({"metadata": {}, "spec": {}}, c, lambda *a: None, na.PathMap({}))


def test_mount_paths_are_rewritten_only_as_whole_path_prefixes() -> None:
    paths = na.PathMap({"/etc/seqtrain": "/l/cfg", "/checkpoints": "/l/ck", "/tmp": "/l/tmp"})
    text = json.dumps({"workdir": "/checkpoints/j", "ck": "/checkpoints", "other": "/checkpointsX/a",
                       "nested": "/var/tmp/x", "cfg": "/etc/seqtrain/config.json"})
    out = json.loads(paths.rewrite(text))
    assert out == {"workdir": "/l/ck/j", "ck": "/l/ck", "other": "/checkpointsX/a", "nested": "/var/tmp/x",
                   "cfg": "/l/cfg/config.json"}


def test_quantities() -> None:
    assert na.quantity_bytes("1Gi") == 2**30 and na.quantity_bytes("500M") == 500 * 10**6
    assert na.quantity_bytes("1024") == 1024 and na.quantity_bytes(None) is None


def test_terminated_reasons() -> None:
    ok = na.terminated_state(0, False, "", "t0", "t1")
    assert (ok["exitCode"], ok["reason"]) == (0, "Completed")
    err = na.terminated_state(3, False, "bad config", "t0", "t1")
    assert (err["exitCode"], err["reason"], err["message"]) == (3, "Error", "bad config")
    killed = na.terminated_state(0, False, "", "t0", "t1", signalled=9)
    assert (killed["exitCode"], killed["reason"]) == (137, "Error")  # 128 + SIGKILL, no OOM seen
    oom = na.terminated_state(0, True, "", "t0", "t1", signalled=9)
    assert (oom["exitCode"], oom["reason"]) == (137, "OOMKilled")
    assert len(na.terminated_state(1, False, "x" * 10000, "t0", "t1")["message"]) == 4096


def test_fallback_to_logs_is_the_smaller_of_80_lines_and_2048_bytes() -> None:
    lines = b"".join(b"line %d\n" % i for i in range(200))
    msg = na.fallback_message(lines)
    assert msg.splitlines() == [f"line {i}" for i in range(120, 200)]
    long = b"".join(b"%04d" % i + b"y" * 95 + b"\n" for i in range(50))
    assert len(na.fallback_message(long).encode()) == 2048


# ---- the agent with real processes ------------------------------------------------------------------------------


class FakeCore:
    """The few CoreV1Api calls the agent makes, over in-memory pods; records status patches and deletions."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.configmaps: dict[tuple[str, str], dict[str, str]] = {}
        self.statuses: list[tuple[str, dict[str, Any]]] = []
        self.confirmed: list[tuple[str, int]] = []

    def list_pod_for_all_namespaces(self, field_selector: str, _preload_content: bool) -> Any:
        node = field_selector.split("=", 1)[1]
        items = [p for p in self.pods.values() if p["spec"].get("nodeName") == node]
        return SimpleNamespace(data=json.dumps({"items": items}).encode())

    def patch_namespaced_pod_status(self, name: str, ns: str, body: dict[str, Any]) -> None:
        self.pods[name]["status"] = {**self.pods[name].get("status", {}), **body["status"]}
        self.statuses.append((name, body["status"]))

    def delete_namespaced_pod(self, name: str, ns: str, body: Any) -> None:
        assert body.preconditions.uid == self.pods[name]["metadata"]["uid"]
        self.confirmed.append((name, body.grace_period_seconds))
        del self.pods[name]

    def read_namespaced_config_map(self, name: str, ns: str) -> Any:
        return SimpleNamespace(data=self.configmaps[(ns, name)])

    def phases(self, name: str) -> list[str]:
        return [s["phase"] for n, s in self.statuses if n == name and "phase" in s]


def make_pod(name: str, script: str, grace: int = 30, policy: str = "File", **extra: Any) -> dict[str, Any]:
    # The emptyDir is mounted at /scratch, not /tmp: the command is this interpreter, which lives under /tmp when
    # the clone does, and the agent maps mount paths in argv.
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": {"nodeName": "cpu-0", "terminationGracePeriodSeconds": grace, "restartPolicy": "Never",
                     "volumes": [{"name": "config", "configMap": {"name": "cfg"}},
                                 {"name": "tmp", "emptyDir": {}}],
                     "containers": [{"name": "main", "image": "unused", "command": [sys.executable, "-c", script],
                                     "args": ["/etc/app/conf.json", "$(POD_NAME)"],
                                     "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {
                                         "fieldPath": "metadata.name"}}}],
                                     "volumeMounts": [{"name": "config", "mountPath": "/etc/app"},
                                                      {"name": "tmp", "mountPath": "/scratch"}],
                                     "terminationMessagePath": "/dev/termination-log",
                                     "terminationMessagePolicy": policy, **extra}]},
            "status": {"phase": "Pending"}}


@pytest.fixture
def agent(tmp_path: Path) -> Any:
    core = FakeCore()
    core.configmaps[("ns", "cfg")] = {"conf.json": json.dumps({"out": "/scratch/out.txt"})}
    a = na.Agent(core, None, ["cpu-0"], tmp_path, {}, {})
    yield a, core
    a.shutdown()


def run_until(a: Any, done: Any, seconds: float = 600) -> None:
    """A hang guard, not a speed limit: generous for a loaded 2-core machine."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "the agent did not get there in time"
        a.sync()
        time.sleep(0.1)


@pytest.mark.slow
def test_a_pod_runs_with_its_config_and_reports_completed_with_the_message(agent: Any) -> None:
    a, core = agent
    # The command writes where its (rewritten) config says, and its message through the mapped path in argv.
    script = ("import json,sys; cfg=json.load(open(sys.argv[1])); open(cfg['out'],'w').write(sys.argv[2]); "
              "open(sys.argv[3],'w').write('all good')")
    pod = make_pod("ok", script, args=["/etc/app/conf.json", "$(POD_NAME)", "/dev/termination-log"])
    core.pods["ok"] = pod
    run_until(a, lambda: core.pods["ok"]["status"]["phase"] == "Succeeded")
    assert core.phases("ok")[:2] == ["Pending", "Running"]
    running = [s for n, s in core.statuses if s.get("phase") == "Running"][0]
    assert running["podIP"] == "127.0.0.1" and running["containerStatuses"][0]["ready"] is True
    assert running["containerStatuses"][0]["started"] is True
    term = core.pods["ok"]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"], term["message"]) == (0, "Completed", "all good")
    out = a.state / "pods" / "uid-ok" / "volumes" / "tmp" / "out.txt"
    assert out.read_text() == "ok"  # $(POD_NAME) expanded; /scratch mapped to the pod's emptyDir


@pytest.mark.slow
def test_a_failure_falls_back_to_the_log_when_the_message_file_is_empty(agent: Any) -> None:
    a, core = agent
    core.pods["bad"] = make_pod("bad", "import sys; print('boom: cannot train'); sys.exit(3)",
                                policy="FallbackToLogsOnError")
    run_until(a, lambda: core.pods["bad"]["status"]["phase"] == "Failed")
    term = core.pods["bad"]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (3, "Error")
    assert "boom: cannot train" in term["message"]


@pytest.mark.slow
def test_deletion_sends_sigterm_and_confirms_only_after_the_process_exits(agent: Any) -> None:
    a, core = agent
    script = ("import signal,sys,time\n"
              "def term(*_):\n  open('/scratch/got-term','w').write('1'); sys.exit(143)\n"
              "signal.signal(signal.SIGTERM, term)\nprint('ready', flush=True)\ntime.sleep(600)")
    core.pods["t"] = make_pod("t", script)
    run_until(a, lambda: core.pods["t"]["status"]["phase"] == "Running")
    log = a.state / "pods" / "uid-t" / "container.log"
    run_until(a, lambda: log.exists() and "ready" in log.read_text())
    core.pods["t"]["metadata"] |= {"deletionTimestamp": "now", "deletionGracePeriodSeconds": 30}
    run_until(a, lambda: "t" not in core.pods)
    assert core.confirmed == [("t", 0)]
    term = [s for n, s in core.statuses if n == "t"][-1]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 143
    assert not (a.state / "pods" / "uid-t").exists()  # the pod's folders go with it


@pytest.mark.slow
def test_a_process_ignoring_sigterm_is_killed_after_the_grace_period(agent: Any) -> None:
    a, core = agent
    script = ("import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
              "time.sleep(600)")
    core.pods["stubborn"] = make_pod("stubborn", script)
    run_until(a, lambda: core.pods["stubborn"]["status"]["phase"] == "Running")
    log = a.state / "pods" / "uid-stubborn" / "container.log"
    run_until(a, lambda: log.exists() and "ready" in log.read_text())
    core.pods["stubborn"]["metadata"] |= {"deletionTimestamp": "now", "deletionGracePeriodSeconds": 1}
    a.sync()
    proc = a.procs["uid-stubborn"]
    assert proc.term_sent is not None and proc.popen.poll() is None and core.confirmed == []
    run_until(a, lambda: "stubborn" not in core.pods)
    assert proc.popen.returncode == -9 and core.confirmed == [("stubborn", 0)]


@pytest.mark.slow
def test_a_process_over_its_memory_limit_is_oom_killed(agent: Any) -> None:
    a, core = agent
    script = "import time; x = bytearray(200 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(600)"
    core.pods["big"] = make_pod("big", script, resources={"limits": {"memory": "64Mi"}})
    run_until(a, lambda: core.pods["big"]["status"]["phase"] == "Failed")
    term = core.pods["big"]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (137, "OOMKilled")


@pytest.mark.slow
def test_pages_shared_by_a_pods_processes_count_once_against_its_memory_limit(agent: Any) -> None:
    """A launcher forks its rank after touching 40 MiB: the two RSS sum to about 100 MiB, over the 64 MiB limit,
    but the pages are shared (copy-on-write), and a memory cgroup would charge them once: the pod keeps running."""
    a, core = agent
    script = ("import os, time; x = bytearray(40 * 2**20); x[::4096] = b'1' * len(x[::4096]); pid = os.fork(); "
              "print('ready' if pid else 'child', flush=True); time.sleep(600)")
    core.pods["forked"] = make_pod("forked", script, resources={"limits": {"memory": "64Mi"}})
    log = a.state / "pods" / "uid-forked" / "container.log"
    run_until(a, lambda: log.exists() and "ready" in log.read_text() and "child" in log.read_text())
    for _ in range(5):
        a.sync()
    assert not a.procs["uid-forked"].oom and core.pods["forked"]["status"]["phase"] == "Running"


@pytest.mark.slow
def test_a_dead_node_kills_its_processes_and_reports_nothing_more(agent: Any) -> None:
    a, core = agent
    core.pods["n"] = make_pod("n", "import time; print('ready', flush=True); time.sleep(600)")
    run_until(a, lambda: core.pods["n"]["status"]["phase"] == "Running")
    proc = a.procs["uid-n"]
    (a.state / "down" / "cpu-0").touch()
    a.sync()
    assert proc.popen.poll() == -9
    reported = len(core.statuses)
    core.pods["n"]["metadata"] |= {"deletionTimestamp": "now", "deletionGracePeriodSeconds": 30}
    for _ in range(5):
        a.sync()
    assert len(core.statuses) == reported and core.confirmed == [] and "n" in core.pods  # stuck Terminating
    (a.state / "down" / "cpu-0").unlink()  # node-up: the agent finds the container gone and confirms
    a.heartbeat = lambda name, first=False: None
    run_until(a, lambda: "n" not in core.pods)
    assert core.confirmed == [("n", 0)]
    term = [s for n, s in core.statuses if n == "n"][-1]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (137, "Error")


@pytest.mark.slow
def test_a_pod_annotated_ignore_deletion_stays_terminating_until_force_deleted(agent: Any) -> None:
    """A wedged kubelet: the deletion is neither acted on (no SIGTERM) nor confirmed; once the pod object is gone
    (a force delete, grace 0), its processes are killed and its folders go."""
    a, core = agent
    core.pods["w"] = make_pod("w", "import time; print('ready', flush=True); time.sleep(600)")
    run_until(a, lambda: core.pods["w"]["status"]["phase"] == "Running")
    proc = a.procs["uid-w"]
    core.pods["w"]["metadata"] |= {"deletionTimestamp": "now", "deletionGracePeriodSeconds": 0,
                                   "annotations": {na.IGNORE_DELETION: "true"}}
    for _ in range(5):
        a.sync()
    assert proc.term_sent is None and proc.popen.poll() is None and core.confirmed == [] and "w" in core.pods
    del core.pods["w"]  # force-deleted
    a.sync()
    assert proc.popen.poll() == -9 and "uid-w" not in a.procs and not (a.state / "pods" / "uid-w").exists()
    assert core.confirmed == []


SLEEPER = {"name": "log-shipper", "image": "unused", "command": ["sleep", "3600"]}


@pytest.mark.slow
def test_a_native_sidecar_is_stopped_once_the_main_container_exits_and_the_pod_succeeds(agent: Any) -> None:
    a, core = agent
    pod = make_pod("side", "print('trained')")
    pod["spec"]["initContainers"] = [{**SLEEPER, "restartPolicy": "Always"}]
    core.pods["side"] = pod
    run_until(a, lambda: core.pods["side"]["status"]["phase"] == "Succeeded")
    running = [s for n, s in core.statuses if s.get("phase") == "Running"][0]
    assert "running" in running["initContainerStatuses"][0]["state"]  # started before the main container
    status = core.pods["side"]["status"]
    assert [c["name"] for c in status["containerStatuses"]] == ["main"]
    (sidecar,) = status["initContainerStatuses"]
    assert sidecar["name"] == "log-shipper" and sidecar["state"]["terminated"]["exitCode"] == 128 + 15  # SIGTERM


@pytest.mark.slow
def test_a_regular_second_container_keeps_the_pod_running_after_the_first_exits(agent: Any) -> None:
    a, core = agent
    pod = make_pod("two", "import sys; sys.exit(1)")
    pod["spec"]["containers"].append(SLEEPER)
    core.pods["two"] = pod

    def main_state() -> dict[str, Any]:
        return next((c["state"] for c in core.pods["two"]["status"].get("containerStatuses", [])
                     if c["name"] == "main"), {})
    run_until(a, lambda: "terminated" in main_state())
    status = core.pods["two"]["status"]
    assert status["phase"] == "Running" and main_state()["terminated"]["exitCode"] == 1  # as a kubelet reports it
    assert "running" in status["containerStatuses"][1]["state"]


def test_a_pod_it_cannot_run_says_why(tmp_path: Path) -> None:
    core = FakeCore()
    pod = make_pod("x", "pass")
    pod["spec"]["containers"][0].pop("command")
    core.pods["x"] = pod
    core.configmaps[("ns", "cfg")] = {}
    a = na.Agent(core, None, ["cpu-0"], tmp_path, {}, {})
    a.sync()
    waiting = core.pods["x"]["status"]["containerStatuses"][0]["state"]["waiting"]
    assert waiting["reason"] == "CreateContainerConfigError" and "no command" in waiting["message"]


def test_the_kubernetes_service_env_names_the_apiserver() -> None:
    assert na.service_env("https://127.0.0.1:6443") == {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443",
        "KUBERNETES_SERVICE_PORT_HTTPS": "6443", "KUBERNETES_PORT": "tcp://127.0.0.1:6443"}


@pytest.mark.slow
def test_progress_output_after_the_error_line_never_becomes_the_reported_reason(agent: Any) -> None:
    """Issue 27's message, `failed (RankFailed, exit code 1): 914 mem 752MB`, was the head of the 2048-byte log
    tail. A real process prints progress, its error line, more progress; the agent keeps the tail as the kubelet
    does (FallbackToLogsOnError, the message file left empty), and the operator reports the error line."""
    from datetime import datetime, timezone

    from seqtrain_operator.controller.failure_policy import classify
    from seqtrain_operator.k8s.pods.observe import observe_replicas

    a, core = agent
    script = ("import sys\n"
              "step = lambda s: print(f'step {s}/80 loss 4.4320 lr 1.73e-04 grad_norm 1.957 tok/s 7914 mem 752MB')\n"
              "[step(s) for s in range(1, 40)]\n"
              "print('seqtrain train: error: RuntimeError: no space left on device', flush=True)\n"
              "[step(s) for s in range(40, 43)]\n"
              "sys.exit(1)\n")
    pod = make_pod("crash", script, policy="FallbackToLogsOnError")
    pod["spec"]["containers"][0]["name"] = "trainer"  # observation reads the trainer container's status only
    pod["metadata"]["labels"] = {"seqtrain.dev/replica": "0", "seqtrain.dev/attempt": "1"}
    core.pods["crash"] = pod
    run_until(a, lambda: core.pods["crash"]["status"]["phase"] == "Failed")
    term = core.pods["crash"]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["message"].splitlines()[-1].startswith("step 42/80") and len(term["message"]) == 2048
    node = {"metadata": {"name": "cpu-0"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    (r,) = observe_replicas([core.pods["crash"]], [node], datetime.now(timezone.utc))
    assert classify(r).message == ("replica 0 on cpu-0 failed (RankFailed, exit code 1): "
                                   "RuntimeError: no space left on device")
