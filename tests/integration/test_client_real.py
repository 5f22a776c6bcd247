"""`seqtrain submit|list|status|logs|wait|delete|suspend|resume` and `seqtrain.client.Client` on the real control
plane (scripts/testbed.sh): the chart's operator, kube-scheduler, the node agent running real CPU ranks, and the
API server serving `pods/log` from the agent's kubelet log endpoint (tests/testbed/kubelet_logs.py).

The CLI test follows rank 0's log with `logs -f` from before the first pod exists, through a killed pod whose gang
is re-created (new pod names, attempt 2), to the job's end, where it must exit by itself. The Python test submits,
suspends, resumes, reads logs and deletes. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.fixtures import ROOT, TB, Operator, Testbed, wait

pytestmark = pytest.mark.slow

STEPS, HOLD_AT = 40, 12  # checkpoints every 10 steps: attempt 1 holds after step 12, past the one at 10
RUN_TIMEOUT = 900  # seconds for a 2-rank CPU run on a loaded 2-core machine; a deadline, not a measurement
SEQTRAIN = str(ROOT / ".venv" / "bin" / "seqtrain")


def job_doc(name: str, hold_at_step: int | None = None) -> dict[str, Any]:
    """examples/k8s-cpu.yaml on the agent's CPU nodes; `hold_at_step`: attempt 1 holds after that step until it is
    terminated (seqtrain.runtime.faults), so the test acts mid-run however fast the machine is."""
    doc = yaml.safe_load((ROOT / "examples" / "k8s-cpu.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["training"]["steps"] = STEPS
    doc["spec"]["scheduling"]["nodeSelector"] = {"seqtrain.dev/testbed-agent": "true"}
    if hold_at_step is not None:
        env = [{"name": "SEQTRAIN_FAULT_HOLD_AT_STEP", "value": f"{hold_at_step}:900"},
               {"name": "SEQTRAIN_FAULT_ATTEMPT", "value": "1"}]
        doc["spec"]["podTemplate"] = {"spec": {"containers": [{"name": "trainer", "env": env}]}}
    return doc


@pytest.fixture(scope="module")
def ns(testbed: Testbed, seqtrain_operator: Operator) -> str:
    node = testbed.get("node", "cpu-0") or {}
    port = (((node.get("status") or {}).get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port")
    if not port:
        pytest.fail("the testbed's node agent serves no pod logs (a testbed started before tests/testbed/"
                    "kubelet_logs.py): `scripts/testbed.sh down` and run again", pytrace=False)
    return testbed.checkpoint_namespace("client")


def cli(tb: Testbed, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return tb.run(SEQTRAIN, *args, check=False, timeout=timeout)


def metrics_lines(ns: str, name: str) -> int:
    path = TB / "volumes" / ns / name / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.timeout(2 * RUN_TIMEOUT + 600)
def test_the_cli_submits_follows_a_re_created_gang_to_the_end_waits_lists_shows_and_deletes(
        testbed: Testbed, seqtrain_operator: Operator, ns: str, tmp_path: Path) -> None:
    name = "follow"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_doc(name, hold_at_step=HOLD_AT)))

    bad = cli(testbed, "submit", str(path), "-n", ns, "--set", "training.steps=0")
    assert bad.returncode == 2 and f"{path}: spec.training.steps" in bad.stderr, bad
    assert testbed.get("seqtrainjob", name, ns) is None  # validated here: nothing was created

    out = cli(testbed, "submit", str(path), "-n", ns)
    assert out.returncode == 0 and f"seqtrainjob {name} submitted in namespace {ns}" in out.stdout, out
    again = cli(testbed, "submit", str(path), "-n", ns)
    assert again.returncode == 1 and "already exists" in again.stderr and again.stderr.count("\n") == 1, again

    # Follow rank 0 from before its first pod exists; it must end by itself when the job ends.
    log_file = tmp_path / "logs-f.txt"
    with open(log_file, "wb") as sink:
        follower = subprocess.Popen([SEQTRAIN, "logs", name, "-f", "-n", ns], stdout=sink, stderr=subprocess.STDOUT,
                                    env={**os.environ, "KUBECONFIG": str(testbed.kubeconfig)}, start_new_session=True)
    try:
        running = cli(testbed, "wait", name, "--for", "Running", "--timeout", f"{RUN_TIMEOUT}s", "-n", ns,
                      timeout=RUN_TIMEOUT + 60)
        assert running.returncode == 0 and f"{name}: Running" in running.stdout, running

        wait(f"{name} held after step {HOLD_AT}", lambda: metrics_lines(ns, name) >= HOLD_AT, RUN_TIMEOUT, 0.5)
        listed = cli(testbed, "list", "-n", ns)
        print(f"\n$ seqtrain list -n {ns}   # attempt 1, held after step {HOLD_AT}\n{listed.stdout}")
        header, *rows = listed.stdout.splitlines()
        assert header.split() == ["NAME", "PHASE", "STEP", "LOSS", "TOK/S", "RESTARTS", "ETA", "AGE"]
        row = next(r.split() for r in rows if r.startswith(f"{name} "))
        assert row[1] == "Running" and re.fullmatch(rf"\d+/{STEPS}", row[2]), row

        victim = testbed.get("pods", namespace=ns, selector=f"seqtrain.dev/job={name},seqtrain.dev/replica=1")[0]
        pgid = testbed.pod_pid(victim["metadata"]["uid"])
        assert pgid is not None
        os.killpg(pgid, signal.SIGKILL)  # the pod dies with its launcher: the operator re-creates the gang

        done = cli(testbed, "wait", name, "--timeout", f"{RUN_TIMEOUT}s", "-n", ns, timeout=RUN_TIMEOUT + 60)
        assert done.returncode == 0 and f"{name}: Succeeded at step {STEPS}/{STEPS}" in done.stdout, (
            done, seqtrain_operator.logs())
        other = cli(testbed, "wait", name, "--for", "Failed", "-n", ns)
        assert other.returncode == 1 and f"{name}: Succeeded" in other.stderr, other

        assert follower.wait(timeout=180) == 0  # ended with the job
    finally:
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait(timeout=30)
    text = log_file.read_text(errors="replace")
    print(f"$ seqtrain logs {name} -f -n {ns}\n{text}")
    lines = text.splitlines()
    assert all(line.startswith(("[rank 0] ", "[seqtrain] ")) for line in lines), lines[:20]
    marker = next(i for i, line in enumerate(lines) if line.startswith("[seqtrain] attempt 2:"))
    assert any(f"seqtrain: {name} attempt 1, fresh start" in line for line in lines[:marker]), text
    after = "\n".join(lines[marker:])
    assert re.search(rf"\[rank 0\] seqtrain: {name} attempt 2, resumed from step \d+", after), text
    assert f"step {STEPS}/{STEPS} loss" in after and f"at step {STEPS}/{STEPS}" in after, text

    status = cli(testbed, "status", name, "-n", ns)
    print(f"$ seqtrain status {name} -n {ns}\n{status.stdout}")
    assert status.returncode == 0, status
    assert "Phase:      Succeeded" in status.stdout and f"step {STEPS}/{STEPS} (100.0%)" in status.stdout
    assert re.search(r"Checkpoint: step \d+ at ", status.stdout) and "Lost time:" in status.stdout
    assert re.search(r"Restarts:\s+\d", status.stdout) and "from checkpoint step" in status.stdout, status.stdout
    assert "Events (last" in status.stdout and "Restarted" in status.stdout
    listed = cli(testbed, "list", "-n", ns)
    print(f"$ seqtrain list -n {ns}\n{listed.stdout}")
    row = next(r.split() for r in listed.stdout.splitlines() if r.startswith(f"{name} "))
    assert row[1:3] == ["Succeeded", f"{STEPS}/{STEPS}"] and int(row[5]) >= 1 and row[6] == "-", row
    kubectl = testbed.kubectl("get", "stj", name, "-n", ns).stdout.splitlines()
    assert kubectl[0].split()[:5] == ["NAME", "PHASE", "REPLICAS", "STEP", "LOSS"] and "ETA" in kubectl[0].split()
    assert kubectl[1].split()[3] == f"{STEPS}/{STEPS}", kubectl  # the printer column from progress.stepDisplay

    gone = cli(testbed, "delete", name, "--wait", "-n", ns, timeout=360)
    assert gone.returncode == 0 and f"seqtrainjob {name} deleted" in gone.stdout, gone
    assert testbed.get("seqtrainjob", name, ns) is None
    assert not testbed.get("pods", namespace=ns, selector=f"seqtrain.dev/job={name}")
    missing = cli(testbed, "status", name, "-n", ns)
    assert missing.returncode == 1 and "not found" in missing.stderr and missing.stderr.count("\n") == 1, missing


@pytest.mark.timeout(RUN_TIMEOUT + 600)
def test_logs_follow_survives_an_in_place_restart_and_ends_when_the_job_is_deleted(
        testbed: Testbed, seqtrain_operator: Operator, ns: str, tmp_path: Path) -> None:
    from test_testbed_inplace_restart import container_log, rank_pid  # the in-place test's pod helpers

    name = "inplace"
    doc = job_doc(name)
    doc["spec"]["training"]["steps"] = 5000  # never ends by itself: the test deletes it
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert cli(testbed, "submit", str(path), "-n", ns).returncode == 0
    log_file = tmp_path / "logs-f.txt"
    with open(log_file, "wb") as sink:
        follower = subprocess.Popen([SEQTRAIN, "logs", name, "-f", "-n", ns], stdout=sink, stderr=subprocess.STDOUT,
                                    env={**os.environ, "KUBECONFIG": str(testbed.kubeconfig)}, start_new_session=True)
    try:
        wait(f"{name} past step 12", lambda: metrics_lines(ns, name) >= 12, RUN_TIMEOUT, 0.5)
        pods = {int(p["metadata"]["labels"]["seqtrain.dev/replica"]): p
                for p in testbed.get("pods", namespace=ns, selector=f"seqtrain.dev/job={name}")}
        wait("both pods' spare ranks ready", lambda: all("ready for in-place restart 1" in container_log(p)
                                                         for p in pods.values()), RUN_TIMEOUT, 0.5)
        os.kill(rank_pid(testbed, pods[1]), signal.SIGKILL)  # one rank: the launchers restart all ranks in place
        status = wait("the in-place restart counted", lambda: (st := (testbed.get("seqtrainjob", name, ns) or {})
                                                               .get("status") or {}).get("inPlaceRestarts") and st,
                      RUN_TIMEOUT, 1)
        assert status["attempt"] == 1, status  # same pods, same attempt
        wait("rank 0's restarted process in the followed log",
             lambda: log_file.read_text(errors="replace").count(f"seqtrain: {name} attempt 1, ") >= 2, RUN_TIMEOUT, 1)
        assert follower.poll() is None  # still following
        gone = cli(testbed, "delete", name, "--wait", "-n", ns, timeout=360)
        assert gone.returncode == 0, gone
        assert follower.wait(timeout=180) == 0  # the job is gone: the follow ends
    finally:
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait(timeout=30)
        cli(testbed, "delete", name, "-n", ns)
    text = log_file.read_text(errors="replace")
    print(f"$ seqtrain logs {name} -f -n {ns}   # across an in-place restart\n{text}")
    lines = text.splitlines()
    assert all(line.startswith(("[rank 0] ", "[seqtrain] ")) for line in lines), lines[:20]
    assert not any(line.startswith("[seqtrain] attempt") for line in lines)  # never re-created


@pytest.mark.timeout(2 * RUN_TIMEOUT + 600)
def test_the_python_client_submits_suspends_resumes_reads_logs_and_deletes(
        testbed: Testbed, seqtrain_operator: Operator, ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from seqtrain.client import Client, InvalidJob, NotFound, WaitTimeout

    monkeypatch.setenv("KUBECONFIG", str(testbed.kubeconfig))
    c = Client(namespace=ns)
    name = "py-client"
    bad = job_doc(name)
    bad["spec"]["training"]["globalBatchSize"] = 3  # not a multiple of microBatchSize x replicas
    with pytest.raises(InvalidJob) as refused:
        c.submit(bad)
    assert refused.value.exit_code == 2 and name not in [j.name for j in c.list()]

    job = c.submit(job_doc("ignored", hold_at_step=3), name=name)
    assert (job.name, job.namespace) == (name, ns)
    try:
        job = c.wait(name, "Running", timeout=RUN_TIMEOUT)
        assert job.status.attempt == 1 and name in [j.name for j in c.list()]
        started = f"seqtrain: {name} attempt 1, fresh start"
        lines = wait("rank 0's log up to its first step", lambda: (got := list(c.logs(name)))
                     and any(started in line for line in got) and got, RUN_TIMEOUT, 2)
        assert all(line.startswith("[rank 0] ") for line in lines), lines
        both = wait("both ranks' logs", lambda: (got := list(c.logs(name, all_ranks=True)))
                    and any(line.startswith("[rank 1] ") for line in got) and got, RUN_TIMEOUT, 2)
        assert {line.split("]")[0] for line in both} == {"[rank 0", "[rank 1"}

        job = c.suspend(name)
        assert job.suspended
        job = c.wait(name, "Suspended", timeout=RUN_TIMEOUT)
        wait("the suspended job's pods gone",
             lambda: not testbed.get("pods", namespace=ns, selector=f"seqtrain.dev/job={name}"), RUN_TIMEOUT)
        job = c.resume(name)
        assert not job.suspended
        job = c.wait(name, "Running", timeout=RUN_TIMEOUT)
        assert job.status.attempt >= 2, job.status
        with pytest.raises(WaitTimeout):
            c.wait(name, "Succeeded", timeout=0.5)
        assert [e.reason for e in c.events(name) if e.reason == "Suspended"]
    finally:
        with contextlib.suppress(NotFound):
            c.delete(name, wait=True, timeout=300)
    with pytest.raises(NotFound):
        c.get(name)
    assert not testbed.get("pods", namespace=ns, selector=f"seqtrain.dev/job={name}")


@pytest.mark.timeout(RUN_TIMEOUT)
def test_the_local_client_runs_follows_suspends_resumes_and_deletes(tmp_path: Path) -> None:
    """Client(local=True): the same calls on run folders, `seqtrain run` in the background (no cluster needed)."""
    from seqtrain.client import Client, NotFound

    c = Client(local=True, runs_dir=str(tmp_path / "runs"))
    doc = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "local"},
           "spec": {"replicas": 1, "resources": {"gpus": 0}, "model": {"arch": "gpt", "preset": "tiny"},
                    "data": {"source": "builtin", "seqLen": 32},
                    "training": {"steps": 2000, "globalBatchSize": 4, "microBatchSize": 4, "logEvery": 5},
                    "checkpoint": {"intervalSteps": 5}}}
    job = c.submit(doc)
    assert job.workdir == str(tmp_path / "runs" / "local")
    try:
        seen = []
        for line in c.logs("local", follow=True):  # stops reading once training is under way
            seen.append(line)
            if "step 10/2000" in line:
                break
        assert seen[0].startswith("[rank 0] ") and any("attempt 1, fresh start" in line for line in seen), seen
        assert c.wait("local", "Running", timeout=60).phase == "Running"
        # status.json follows the rank's log (the runner writes it on its own beat): wait for it, do not race it
        wait("the status at step 10", lambda: (c.get("local").step or 0) >= 10, 120, 0.5)
        assert c.suspend("local").phase == "Suspended"
        assert "local" in [j.name for j in c.list()]
        c.resume("local")
        wait("attempt 2 resumed from a checkpoint", lambda: any(
            "attempt 2, resumed from step" in line for line in c.logs("local", attempt=2)), RUN_TIMEOUT, 1)
    finally:
        c.delete("local")
    with pytest.raises(NotFound):
        c.get("local")
    assert not (tmp_path / "runs" / "local").exists()
