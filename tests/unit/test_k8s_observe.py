"""Pods and nodes -> what the controller core sees; goodput accounting; the operator's command line."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from seqtrain.spec.status import Condition, JobStatus, LostSeconds, Progress
from seqtrain_operator.controller import goodput
from seqtrain_operator.controller.failure_policy import FailureClass, classify
from seqtrain_operator.k8s.pods.observe import (
    Reported,
    failure_message,
    final_progress,
    observe_replicas,
    progress_from_json,
    rank0_ip,
)

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)


def node(name, ready="True", since="2026-11-22T11:59:50Z"):
    return {"metadata": {"name": name}, "status": {"conditions": [
        {"type": "Ready", "status": ready, "lastTransitionTime": since}]}}


def pod(replica=0, attempt=1, phase="Running", node_name="n1", term=None, waiting=None, reason=None,
        deleting=False, conditions=None, ip=None):
    state = {"terminated": term} if term else ({"waiting": waiting} if waiting else {"running": {}})
    status = {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state}]}
    if reason:
        status["reason"] = reason
    if conditions:
        status["conditions"] = conditions
    if ip:
        status["podIP"] = ip
    meta = {"name": f"j-{attempt}-{replica}", "labels": {"seqtrain.dev/replica": str(replica),
                                                         "seqtrain.dev/attempt": str(attempt)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-22T11:59:00Z"
    return {"metadata": meta, "spec": {"nodeName": node_name}, "status": status}


CASES = [
    ("running", pod(), "Running", None, None, None),
    ("pending unscheduled", pod(phase="Pending", node_name=None, waiting={"reason": "ContainerCreating"}),
     "Pending", None, None, None),
    ("crash", pod(phase="Failed", term={"exitCode": 1, "reason": "Error"}), "Failed", None, 1, FailureClass.USER),
    ("invalid config", pod(phase="Failed", term={"exitCode": 3}), "Failed", None, 3, FailureClass.PERMANENT),
    ("oom", pod(phase="Failed", term={"exitCode": 137, "reason": "OOMKilled"}), "Failed", "OOMKilled", 137,
     FailureClass.USER),
    ("evicted", pod(phase="Failed", reason="Evicted"), "Failed", "Evicted", None, FailureClass.DISRUPTION),
    ("preempted", pod(phase="Failed", term={"exitCode": 143}, conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]),
     "Failed", "Preempted", 143, FailureClass.DISRUPTION),
    ("deleted by someone", pod(deleting=True), "Failed", "Deleted", None, FailureClass.INFRASTRUCTURE),
    ("evicted by the taint manager from a NotReady node", pod(deleting=True, conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}]),
     "Failed", "NodeLost", None, FailureClass.INFRASTRUCTURE),
    ("node not ready long", pod(node_name="down"), "Failed", "NodeUnreachable", None,
     FailureClass.INFRASTRUCTURE),
    ("node not ready briefly", pod(node_name="blip"), "Running", None, None, None),
    ("node removed", pod(node_name="gone"), "Failed", "NodeLost", None, FailureClass.INFRASTRUCTURE),
    ("bad image", pod(phase="Pending", waiting={"reason": "InvalidImageName"}), "Failed", "InvalidImageName", None,
     FailureClass.PERMANENT),
    ("image pull blip", pod(phase="Pending", waiting={"reason": "ErrImagePull"}), "Pending", "ErrImagePull", None,
     None),
    ("image pull backoff", pod(phase="Pending", waiting={"reason": "ImagePullBackOff"}), "Pending",
     "ImagePullBackOff", None, None),
    ("kubelet rejected gpu", pod(phase="Failed", reason="OutOfnvidia.com/gpu"), "Failed", "OutOfnvidia.com/gpu",
     None, FailureClass.INFRASTRUCTURE),
    ("kubelet admission error", pod(phase="Failed", reason="UnexpectedAdmissionError"), "Failed",
     "UnexpectedAdmissionError", None, FailureClass.INFRASTRUCTURE),
    ("no cuda", pod(phase="Failed", term={"exitCode": 5, "reason": "Error"}), "Failed", None, 5,
     FailureClass.INFRASTRUCTURE),
]


@pytest.mark.parametrize("name,p,phase,reason,code,cls", CASES, ids=[c[0] for c in CASES])
def test_pod_to_replica_observation(name, p, phase, reason, code, cls):
    nodes = [node("n1"), node("down", "False", "2026-11-22T11:58:00Z"), node("blip", "False", "2026-11-22T11:59:50Z")]
    (r,) = observe_replicas([p], nodes, NOW, node_lost_grace=40)
    assert (r.phase, r.reason, r.exit_code) == (phase, reason, code)
    if cls is not None:
        assert classify(r).cls is cls


def test_pod_on_a_dead_node_is_lost_even_while_terminating():
    nodes = [node("n1"), fenced(node("down", "Unknown", "2026-11-22T11:58:00Z")),
             node("blip", "Unknown", "2026-11-22T11:59:50Z")]
    (r,) = observe_replicas([pod(node_name="down", deleting=True)], nodes, NOW, node_lost_grace=40)
    assert (r.phase, r.reason, r.terminating, r.node_lost) == ("Failed", "NodeLost", True, True)
    (r,) = observe_replicas([pod(node_name="blip", deleting=True)], nodes, NOW, node_lost_grace=40)
    assert (r.phase, r.reason, r.terminating, r.node_lost) == ("Failed", "Deleted", True, False)
    (r,) = observe_replicas([pod(node_name="gone", phase="Failed", term={"exitCode": 137})], nodes, NOW)
    assert r.node_lost and r.exit_code == 137


def fenced(n):
    n.setdefault("spec", {})["taints"] = [{"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown",
                                           "effect": "NoExecute"}]
    return n


def test_an_unreachable_node_is_never_taken_for_dead_until_it_is_out_of_service():
    # Partitioned, not dead: its pods may still run and write checkpoints. Force-deleting them after 40 s made two
    # gangs write one checkpoint folder.
    nodes = [node("down", "Unknown", "2026-11-22T11:58:00Z")]
    (r,) = observe_replicas([pod(node_name="down")], nodes, NOW, node_lost_grace=40)
    assert (r.phase, r.reason, r.node_lost, r.node_unready) == ("Failed", "NodeUnreachable", False, True)
    assert "node.kubernetes.io/out-of-service" in r.message and classify(r).cls is FailureClass.INFRASTRUCTURE
    (r,) = observe_replicas([pod(node_name="down", deleting=True)], nodes, NOW, node_lost_grace=40)
    assert (r.reason, r.node_lost) == ("NodeUnreachable", False)
    (r,) = observe_replicas([pod(node_name="down", deleting=True)], [fenced(nodes[0])], NOW, node_lost_grace=40)
    assert (r.reason, r.node_lost) == ("NodeLost", True)


def test_pods_without_labels_are_ignored_and_order_is_stable():
    stray = {"metadata": {"name": "x", "labels": {}}, "spec": {}, "status": {}}
    got = observe_replicas([pod(1, 2), stray, pod(0, 2), pod(0, 1)], [node("n1")], NOW)
    assert [(r.attempt, r.replica) for r in got] == [(1, 0), (2, 0), (2, 1)]


def test_progress_sources():
    data = {"step": 5, "totalSteps": 9, "loss": 1.5, "lastCheckpoint": {"step": 4, "path": "/c/step-4"}}
    prog, ck, skipped = progress_from_json(data)[:3]
    assert prog.step == 5 and prog.loss == 1.5 and ck.step == 4 and skipped == ()
    assert progress_from_json({"nope": 1}) == Reported()
    data["skippedCheckpoints"] = [{"step": 3, "reason": "refused: planted pickle"}, {"bad": 1}]
    assert progress_from_json(data).skipped == ((3, "refused: planted pickle"),)
    done = pod(phase="Succeeded", term={"exitCode": 0, "message": json.dumps({"step": 9, "loss": 0.5})})
    prog, ck, _ = final_progress([done], attempt=1)[:3]
    assert prog.step == 9 and ck is None
    assert final_progress([done], attempt=2) == Reported()


def test_progress_document_carries_checkpoint_policy_and_work_at_risk():
    data = {"step": 12, "totalSteps": 90, "checkpointPolicy": {"intervalSteps": 7, "saveSeconds": 0.5,
            "mtbfSeconds": 60.0, "sources": {"intervalSteps": "youngDaly", "mtbfSeconds": "measured"}},
            "workAtRisk": {"checkpointStep": 7, "steps": 5, "seconds": 2.5}}
    r = progress_from_json(data)
    assert r.policy.interval_steps == 7 and r.policy.sources["mtbfSeconds"] == "measured"
    assert r.at_risk.steps == 5 and r.at_risk.checkpoint_step == 7
    assert "checkpointPolicy" not in r.progress.model_dump(by_alias=True)  # not copied into status.progress
    data["workAtRisk"] = {"steps": "many"}  # the pod is the user's: a bad figure is dropped, the rest kept
    assert progress_from_json(data).at_risk is None and progress_from_json(data).progress.step == 12
    assert rank0_ip([pod(ip="10.0.0.5"), pod(replica=1, ip="10.0.0.6")], 1) == "10.0.0.5"


def test_goodput_is_productive_time_over_the_accounted_wall_time_and_running_seconds_still_add_up():
    start = NOW - timedelta(seconds=100)
    running = JobStatus(start_time=start.isoformat(), conditions=[
        Condition(type="Running", status="True", last_transition_time=(NOW - timedelta(seconds=60)).isoformat())],
        progress=Progress(step=30), steps_lost=[10])
    after = running.model_copy(deep=True)
    after.conditions[0].status = "False"  # this decision ended the Running segment
    after.productive_seconds, after.lost_seconds = 45.0, LostSeconds(queueing=20, startup=10, restart=25)
    goodput.account(running, after, NOW)
    assert goodput.running_seconds(after) == 60.0
    assert after.goodput == pytest.approx(45 / 100)  # productive over productive + every lost reason
    later = after.model_copy(deep=True)
    goodput.account(after, later, NOW + timedelta(seconds=100))  # idle: running time does not grow
    assert goodput.running_seconds(later) == 60.0


def test_operator_cli_rejects_bad_scheduler_name(capsys, monkeypatch):
    from seqtrain_operator.k8s.main import build_parser, main

    # main() switches path checks off for the operator's process; keep that out of the tests that follow
    monkeypatch.setenv("SEQTRAIN_CHECK_PATHS", "1")

    args = build_parser().parse_args(["-n", "a", "-n", "b", "--peering", "x", "--metrics-port", "9090"])
    assert args.namespace == ["a", "b"] and args.peering == "x" and args.metrics_port == 9090
    with pytest.raises(SystemExit):
        main(["--scheduler-name", "slurm=x"])
    assert "expected GANG=NAME" in capsys.readouterr().err


@pytest.mark.slow
def test_operator_modules_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys\n"
            "import seqtrain_operator.k8s.process.handlers, seqtrain_operator.k8s.main\n"
            "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')], 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_status_is_written_only_on_change_goodput_alone_is_not_a_change():
    from seqtrain_operator.k8s.passes.statuspatch import changed as _changed

    old = {"phase": "Running", "goodput": 0.5, "progress": {"step": 3}}
    assert not _changed(old, {**old, "goodput": 0.51})
    assert _changed(old, {**old, "progress": {"step": 4}, "goodput": 0.51})
    assert _changed(old, {**old, "phase": "Restarting"})
    # within Config.progress_interval of the last write, progress alone waits; a phase change carries it along
    assert not _changed(old, {**old, "progress": {"step": 4}}, coalesce_progress=True)
    assert _changed(old, {**old, "progress": {"step": 4}, "phase": "Succeeded"}, coalesce_progress=True)
def test_error_line_from_the_termination_message_log_tail():
    tail = "Traceback ...\nseqtrain train: error: RuntimeError: no space left on device (28)\n"
    failed = pod(phase="Failed", term={"exitCode": 1, "message": tail})
    (r,) = observe_replicas([failed], [node("n1")], NOW)
    assert r.error == "RuntimeError: no space left on device (28)"
    done = pod(phase="Failed", term={"exitCode": 1, "message": json.dumps({"step": 3})})
    assert observe_replicas([done], [node("n1")], NOW)[0].error is None


def progress_line(step: int) -> str:
    return f"step {step}/80 loss 4.4320 lr 1.73e-04 grad_norm 1.957 tok/s 7914 mem 752MB"


def log_tail(*lines: str) -> str:
    """What the kubelet keeps with FallbackToLogsOnError: the log's last 2048 bytes (cut mid-line at the start)."""
    return "\n".join(lines).encode()[-2048:].decode()


ERROR = "RuntimeError: Parent directory /checkpoints/j/.tmp-step-20 does not exist."
FAILURE_MESSAGES = [
    ("the error line, progress output planted after it",
     log_tail(*[progress_line(s) for s in range(1, 40)], "Traceback (most recent call last):", "  File ...",
              ERROR, f"seqtrain train: error: {ERROR}", progress_line(40), progress_line(41)), ERROR),
    ("what the trainer wrote to its termination-message file", f"seqtrain train: error: {ERROR}\n", ERROR),
    ("no error line: the last whole line that is not progress",
     log_tail(*[progress_line(s) for s in range(1, 41)], "seqtrain: fault injection: rank 1 kills itself after step 40",
              progress_line(41)), "seqtrain: fault injection: rank 1 kills itself after step 40"),
    ("nothing but progress output (an OOM kill): nothing", log_tail(*[progress_line(s) for s in range(1, 60)]), ""),
    ("a tail cut mid-line never yields its first fragment", log_tail("x" * 3000), ""),
    ("the progress JSON of an orderly exit", json.dumps({"step": 3}), ""),
    ("no message", None, ""),
]


@pytest.mark.parametrize("text,want", [c[1:] for c in FAILURE_MESSAGES], ids=[c[0] for c in FAILURE_MESSAGES])
def test_the_failure_message_is_the_error_line_never_a_fragment_of_progress_output(text, want):
    assert failure_message(text) == want


def test_a_failed_replica_is_reported_with_its_error_line():
    """The reason is the rank's error line, never the head of a log tail cut mid-line (`914 mem 752MB`)."""
    tail = FAILURE_MESSAGES[0][1]
    assert not tail.startswith("step ") and "mem 752MB" in tail.splitlines()[0]  # cut mid-line by the kubelet
    (r,) = observe_replicas([pod(phase="Failed", term={"exitCode": 1, "reason": "Error", "message": tail})],
                            [node("n1")], NOW)
    assert r.message == ERROR and r.error == ERROR
    assert classify(r).message == f"replica 0 on n1 failed (RankFailed, exit code 1): {ERROR}"


def test_error_line_helpers():
    from seqtrain.runtime.exitcodes import error_line, last_error

    assert error_line(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert error_line(KeyError()) == "KeyError"
    assert last_error("x\nseqtrain train: error: A: 1\ny\nseqtrain train: error: B: 2\nz") == "B: 2"
    assert last_error("no marker here") is None and last_error(None) is None


def test_a_pod_is_awaiting_the_scheduler_until_bound_or_refused():
    from seqtrain_operator.k8s.pods.observe import awaiting_scheduler

    fresh = {"spec": {}, "status": {"phase": "Pending"}}
    assert awaiting_scheduler(fresh)
    assert not awaiting_scheduler({"spec": {"nodeName": "n1"}, "status": {"phase": "Pending"}})
    refused = {"spec": {}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}
    assert not awaiting_scheduler(refused)
    assert not awaiting_scheduler({"spec": {}, "status": {"phase": "Running"}})


def with_sidecar(phase, trainer_state, sidecar_state, reason=None, conditions=None, first="istio-proxy"):
    """A pod with an injected sidecar (a container the operator did not put there), listed before the trainer."""
    p = pod(phase=phase, reason=reason, conditions=conditions)
    trainer = {"name": "trainer", "state": trainer_state}
    other = {"name": first, "state": sidecar_state}
    p["status"]["containerStatuses"] = [other, trainer]
    return p


RUNNING, DONE, CRASHED = {"running": {}}, {"terminated": {"exitCode": 0}}, {"terminated": {"exitCode": 1}}


@pytest.mark.parametrize("name,p,phase,code", [
    ("trainer succeeded beside a running sidecar", with_sidecar("Running", DONE, RUNNING), "Succeeded", 0),
    ("trainer crashed beside a running sidecar", with_sidecar("Running", CRASHED, RUNNING), "Failed", 1),
    ("trainer succeeded, the sidecar failed after", with_sidecar("Failed", DONE, CRASHED), "Succeeded", 0),
    ("trainer running, the sidecar crashed", with_sidecar("Running", RUNNING, CRASHED), "Running", None),
    ("trainer crashed, the sidecar exited 0", with_sidecar("Failed", CRASHED, DONE), "Failed", 1),
    ("no trainer status yet: the sidecar's says nothing", dict(with_sidecar("Running", RUNNING, CRASHED), status={
        "phase": "Running", "containerStatuses": [{"name": "istio-proxy", "state": CRASHED}]}), "Running", None),
    ("the pod was evicted: its reason stands", with_sidecar("Failed", DONE, CRASHED, reason="Evicted"), "Failed", 0),
    ("the pod was preempted: its reason stands", with_sidecar("Failed", DONE, CRASHED, conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]), "Failed", 0),
])
def test_the_trainer_container_decides_the_replica_outcome_not_a_sidecar(name, p, phase, code):
    (r,) = observe_replicas([p], [node("n1")], NOW)
    assert (r.phase, r.exit_code) == (phase, code), name


def test_a_crash_beside_a_sidecar_is_classified_like_any_crash_and_the_endpoint_is_not_polled():
    p = with_sidecar("Running", {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}, RUNNING)
    p["status"]["podIP"] = "10.0.0.5"
    (r,) = observe_replicas([p], [node("n1")], NOW)
    assert (r.phase, r.reason, classify(r).cls) == ("Failed", "OOMKilled", FailureClass.USER)
    assert rank0_ip([p], 1) is None  # the trainer's progress server is gone with it


def test_in_cluster_login_uses_the_service_env_the_kubelet_sets_not_cluster_dns() -> None:
    # kopf's helper names https://kubernetes.default.svc: a pod without cluster DNS never reached the API server.
    from seqtrain_operator.k8s.process.handlers import in_cluster_server

    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_server(env, "https://kubernetes.default.svc") == "https://10.96.0.1:443"
    assert in_cluster_server({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}, "x") == \
        "https://[fd00::1]:6443"
    assert in_cluster_server({}, "https://kubernetes.default.svc") == "https://kubernetes.default.svc"


def test_a_pod_terminating_long_past_its_grace_on_a_ready_node_is_overdue() -> None:
    # deletionTimestamp 11:59:00 is when its grace period ended; NOW is 12:00:00
    (r,) = observe_replicas([pod(deleting=True)], [node("n1")], NOW)
    assert r.terminating and not r.overdue  # 60 s: the kubelet may still be confirming
    later = NOW + timedelta(seconds=30)
    (r,) = observe_replicas([pod(deleting=True)], [node("n1")], later)
    assert r.overdue
    held = pod(deleting=True)
    held["metadata"]["finalizers"] = ["example.com/keep"]  # a finalizer's owner holds it, not the kubelet
    (r,) = observe_replicas([held], [node("n1")], later)
    assert not r.overdue
    (r,) = observe_replicas([pod(node_name="down", deleting=True)], [node("down", ready="False")], later)
    assert not r.overdue  # a node that is not Ready takes the node-lost path
