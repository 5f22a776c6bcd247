"""pytest fixtures for the real control plane of scripts/testbed.sh (docs/development.md, "The testbed").

- `testbed` (session): `scripts/testbed.sh up` once per session (reused when it was already up, and then left
  up), `down` at the end, also on Ctrl-C (pytest tears session fixtures down on KeyboardInterrupt; the components
  run in their own sessions, so the terminal's SIGINT never reaches them).
- `seqtrain_operator` (session): a real `helm install` of charts/seqtrain whose operator does not run in the
  cluster (replicaCount 0; the webhook points at https://127.0.0.1:PORT with the testbed CA), then
  `seqtrain operator` as a local process authenticated by a TokenRequest token of the chart's ServiceAccount:
  exactly the chart's RBAC, the apiserver calling the webhook over TLS.

Without the binaries the tests skip with the command that gets them; under CI=true that is a failure instead.
Every wait has a deadline; none is a timing assertion.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

import suite_parts
from seqtrain.runtime.launch import bindable, free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "testbed.sh"
TB = Path(os.environ.get("TESTBED_DIR", ROOT / ".testbed"))
CI = os.environ.get("CI", "").lower() == "true"
UP_TIMEOUT = 600  # seconds: a cold start on a loaded 2-core machine
RELEASE, RELEASE_NS = "seqtrain", "seqtrain-system"
T = TypeVar("T")


def unavailable(reason: str) -> None:
    """Skip, or under CI=true fail: a control plane that cannot start is never silently skipped in CI."""
    if CI:
        pytest.fail(f"testbed unavailable under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def tool(name: str) -> str:
    path = shutil.which(name) or str(ROOT / ".tools" / "bin" / name)
    if not os.path.exists(path):
        unavailable(f"{name} not found: run `make tools`")
    return path


def binaries() -> str:
    if os.environ.get("SEQTRAIN_K8S_BIN"):
        return os.environ["SEQTRAIN_K8S_BIN"]
    out = subprocess.run([str(ROOT / "scripts" / "k8s-binaries.sh"), "--check"], capture_output=True, text=True)
    if out.returncode != 0:
        unavailable("no Kubernetes control-plane binaries: run `scripts/k8s-binaries.sh` (builds them once, about "
                    "half an hour on 2 cores; `make test` does it)")
    return out.stdout.strip()


OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


def wait(what: str, probe: Callable[[], T], timeout: float, interval: float = 1.0) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` and the last value after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except Exception as e:  # noqa: BLE001 (a probe that raises has not succeeded yet)
            last = e
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not within {timeout:.0f}s (last: {last!r})", pytrace=False)
        time.sleep(interval)


@dataclass
class Testbed:
    """The running control plane, with helpers that talk to it as the admin."""

    __test__ = False  # a fixture's type, not a test class (pytest collects classes named Test*)

    kubeconfig: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120,
            kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}
        out = subprocess.run(list(args), input=input, capture_output=True, text=True, timeout=timeout, env=env)
        if check and out.returncode != 0:
            pytest.fail(f"{' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}", pytrace=False)
        return out

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run(tool("kubectl"), *args, **kw)

    def helm(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run(tool("helm"), *args, **kw)

    def apply(self, manifest: str | dict[str, Any] | list[dict[str, Any]], namespace: str | None = None,
              check: bool = True) -> subprocess.CompletedProcess[str]:
        if not isinstance(manifest, str):
            docs = manifest if isinstance(manifest, list) else [manifest]
            manifest = yaml.safe_dump_all(docs)
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=manifest, check=check)

    def get(self, kind: str, name: str | None = None, namespace: str | None = None,
            selector: str | None = None) -> Any:
        """The object (or the list's items) as JSON; None when a named object does not exist."""
        args = ["get", kind] + ([name] if name else []) + (["-n", namespace] if namespace else [])
        args += ["-l", selector] if selector else []
        out = self.kubectl(*args, "-o", "json", check=False)
        if out.returncode != 0:
            if "NotFound" in out.stderr:
                return None
            pytest.fail(f"kubectl {' '.join(args)}: {out.stderr}", pytrace=False)
        data = json.loads(out.stdout)
        return data if name else data["items"]

    def namespace(self, prefix: str = "t") -> str:
        """A fresh namespace, ready for pods (its default ServiceAccount exists)."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.kubectl("create", "namespace", name)
        wait(f"default ServiceAccount in {name}", lambda: self.get("serviceaccount", "default", name), 120)
        return name

    def checkpoint_namespace(self, prefix: str) -> str:
        """A fresh namespace with the ReadWriteMany claim `seqtrain-ckpt` that examples/k8s-cpu.yaml names: a
        hostPath PV on this machine (the node agent maps the claim to its PV's folder, .testbed/volumes/<ns>),
        bound by the controller-manager's PV controller."""
        name = self.namespace(prefix)
        folder = TB / "volumes" / name
        folder.mkdir(parents=True, exist_ok=True)
        self.apply([
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{name}-ckpt"},
             "spec": {"capacity": {"storage": "5Gi"}, "accessModes": ["ReadWriteMany"],
                      "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "testbed",
                      "hostPath": {"path": str(folder), "type": "Directory"}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "seqtrain-ckpt", "namespace": name},
             "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "testbed", "volumeName": f"{name}-ckpt",
                      "resources": {"requests": {"storage": "5Gi"}}}},
        ])
        wait("the checkpoint claim Bound",
             lambda: (self.get("pvc", "seqtrain-ckpt", name) or {}).get("status", {}).get("phase") == "Bound", 120)
        return name

    def ca_pem(self) -> bytes:
        return (TB / "pki" / "ca.crt").read_bytes()

    def server(self) -> str:
        return yaml.safe_load(self.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]

    def node_down(self, node: str) -> None:
        self.run(str(SCRIPT), "node-down", node)

    def node_up(self, node: str) -> None:
        self.run(str(SCRIPT), "node-up", node)
        self.kubectl("taint", "node", node, f"{OUT_OF_SERVICE}-", check=False)  # if a test fenced it

    def fence(self, node: str) -> None:
        """Confirm a node is down, as an admin does (Kubernetes' non-graceful node shutdown): the out-of-service
        taint. Until then the operator never force-deletes pods that may still run on an unreachable node."""
        self.kubectl("taint", "node", node, f"{OUT_OF_SERVICE}=nodeshutdown:NoExecute", "--overwrite")

    def pod_pid(self, uid: str) -> int | None:
        """The process-group id of a pod the node agent runs (None: not running here)."""
        f = TB / "agent" / "pods" / uid / "pgid"
        return int(f.read_text()) if f.exists() else None


def _status_up() -> bool:
    return subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True, timeout=60).returncode == 0


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    bin_dir = binaries()
    tool("kubectl")
    env = {"SEQTRAIN_K8S_BIN": bin_dir, "KUBECTL": tool("kubectl")}
    was_up = _status_up()
    out = subprocess.run([str(SCRIPT), "up"], capture_output=True, text=True, timeout=UP_TIMEOUT,
                         env={**os.environ, **env})
    if out.returncode != 0:
        subprocess.run([str(SCRIPT), "down"], capture_output=True, timeout=120)
        unavailable(f"scripts/testbed.sh up failed:\n{out.stderr[-3000:]}\n(fix, then `scripts/testbed.sh up` by "
                    "hand to see it start; logs in .testbed/logs)")
    line = [x for x in out.stdout.splitlines() if x.startswith("KUBECONFIG=")][-1]
    try:
        yield Testbed(Path(line.split("=", 1)[1]), env)
    finally:
        if not was_up:  # a testbed the developer started stays up for the next run
            subprocess.run([str(SCRIPT), "down"], capture_output=True, timeout=120)


def rendezvous_band(shard: str) -> tuple[int, int]:
    """This process's part of `free_port`'s band for long-lived reservations: shard K of N (SEQTRAIN_CP_SHARD=K/N,
    scripts/test-halves.sh) takes the K-th of N equal slices, so two shards' operators, each holding its port only
    while a job runs, never pick the same one."""
    k, n = suite_parts.shard_of(shard) or (1, 1)
    return 2000 - (k - 1) * 2000 // n, 2000 - k * 2000 // n


def rendezvous_port() -> int:
    """A free port P with P+1 free too (the in-place restart coordinator's). Every pod here shares the host's
    network and the session's operator gives every job the same P, so it comes from `free_port`'s band for
    long-lived reservations, where no short-lived pick lands."""
    return free_port(2, band=rendezvous_band(os.environ.get("SEQTRAIN_CP_SHARD", "")))


@dataclass
class Operator:
    """The chart's release and the operator running locally as its ServiceAccount."""

    tb: Testbed
    webhook_port: int
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = field(default_factory=free_port)  # the chart's metrics.enabled passes --metrics-port too
    master_port: int = field(default_factory=rendezvous_port)
    kubeconfig: Path = TB / "operator.kubeconfig"
    log: Path = TB / "logs" / "operator.log"
    proxy: Any = None  # a testbed.faultproxy.FaultProxy: the operator talks to the apiserver through it
    source: Path = ROOT  # the checkout whose operator runs (another one: a snapshot of a commit, a before/after)

    def values(self) -> list[str]:
        ca = base64.b64encode(self.tb.ca_pem()).decode()
        # replicaCount 0: the operator runs here as a process; the uninstall hook's Job runs on the agent's nodes.
        return ["--set", "replicaCount=0", "--set", "fullnameOverride=seqtrain",
                "--set", r"nodeSelector.node\.kubernetes\.io/instance-type=testbed-cpu",
                "--set", f"webhook.url=https://127.0.0.1:{self.webhook_port}/validate-seqtrainjob",
                "--set", f"webhook.caBundle={ca}"]

    def install(self) -> None:
        self.tb.helm("upgrade", "--install", RELEASE, str(ROOT / "charts" / "seqtrain"), "--namespace", RELEASE_NS,
                     "--create-namespace", *self.values(), "--wait", "--timeout", "180s", timeout=300)

    def token(self) -> str:
        """A TokenRequest token of the chart's ServiceAccount (what a pod of the Deployment would mount)."""
        return self.tb.kubectl("create", "token", "seqtrain", "-n", RELEASE_NS, "--duration", "6h").stdout.strip()

    def start(self, extra: Sequence[str] = ()) -> None:
        """`extra`: more options, after (so instead of) the chart's, for the tests that need another setting."""
        cfg = {"apiVersion": "v1", "kind": "Config",
               "clusters": [{"name": "testbed", "cluster": {"server": self.tb.server(),
                                                            "certificate-authority": str(TB / "pki" / "ca.crt")}}],
               "users": [{"name": "seqtrain", "user": {"token": self.token()}}],
               "contexts": [{"name": "seqtrain", "context": {"cluster": "testbed", "user": "seqtrain"}}],
               "current-context": "seqtrain"}
        if self.proxy is not None:
            self.proxy.kubeconfig(str(self.kubeconfig), token=cfg["users"][0]["user"]["token"])
        else:
            self.kubeconfig.write_text(yaml.safe_dump(cfg))
        self.kubeconfig.chmod(0o600)
        certs = TB / "webhook-certs"
        certs.mkdir(exist_ok=True)
        shutil.copy(TB / "pki" / "webhook.crt", certs / "tls.crt")
        shutil.copy(TB / "pki" / "webhook.key", certs / "tls.key")
        # The same arguments as the chart's Deployment (templates/deployment.yaml), webhook on loopback. Every pod
        # here shares the host's network: free ports for rendezvous and progress keep two testbeds on one machine
        # (two clones) apart.
        argv = [str(ROOT / ".venv" / "bin" / "python"), "-m", "seqtrain_operator.cli", "operator", "--all-namespaces",
                "--peering=seqtrain",
                f"--progress-port={free_port()}", f"--master-port={self.master_port}", "--termination-grace=30",
                "--rank-mtbf-hours=50000",
                "--node-lost-grace=40", f"--metrics-port={self.metrics_port}",
                f"--webhook-port={self.webhook_port}", f"--webhook-cert-dir={certs}", "--verbose", *extra]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "PYTHONPATH": f"{self.source / 'trainer'}:{self.source / 'operator'}"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

        def serving() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"the operator exited; see {self.log}"
            with socket.create_connection(("127.0.0.1", self.webhook_port), timeout=2):
                return True
        wait("the operator's webhook listening", serving, 180)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def wait_rendezvous_free(self, timeout: float = 120) -> bool:
        """Until no rank of an earlier job listens on the rendezvous ports: deleting a SeqTrainJob returns before its
        pods' processes end (a SIGTERM save runs first), and the next job's rank 0 binds the same port here (one
        network for every pod; on a cluster each pod has its own address). False after the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if bindable(self.master_port) and bindable(self.master_port + 1):
                return True
            time.sleep(0.5)
        return False

    def logs(self, lines: int = 80) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


@pytest.fixture(scope="session")
def seqtrain_operator(testbed: Testbed) -> Iterator[Operator]:
    tool("helm")
    op = Operator(testbed, free_port())
    op.install()
    try:
        op.start()
        yield op
    finally:
        op.stop()


FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Marks the item FAILED when its setup or call failed (for `rendezvous_released`); conftest imports it."""
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    return report


def delete_jobs_since(tb: Testbed, since: float) -> list[str]:
    """Delete every SeqTrainJob created at or after `since` (epoch seconds), without waiting; returns their
    namespace/name. A failed test's job may be left running, holding the rendezvous port that the next test's job
    needs (one port per operator), so one failure would fail the tests after it too."""
    out = tb.kubectl("get", "seqtrainjobs", "-A", "-o", "json", check=False)
    if out.returncode != 0:
        return []
    gone = []
    for item in json.loads(out.stdout).get("items", []):
        meta = item.get("metadata", {})
        created = datetime.fromisoformat(meta.get("creationTimestamp", "1970-01-01T00:00:00Z")).timestamp()
        if created >= int(since):
            tb.kubectl("delete", "seqtrainjob", meta["name"], "-n", meta["namespace"], "--wait=false", check=False)
            gone.append(f"{meta['namespace']}/{meta['name']}")
    return gone


@pytest.fixture(autouse=True)
def rendezvous_released(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test on the operator, its deleted jobs' ranks have let go of the rendezvous ports before the next
    test's job starts (see Operator.wait_rendezvous_free). A test that failed has the jobs it created deleted
    first (`delete_jobs_since`); one that passed but left a job running is not waited for long."""
    started = time.time()
    yield
    if "seqtrain_operator" not in request.fixturenames:
        return
    op = request.getfixturevalue("seqtrain_operator")
    if request.node.stash.get(FAILED, False):
        delete_jobs_since(op.tb, started)
    op.wait_rendezvous_free()


@pytest.fixture
def node_back(testbed: Testbed) -> Iterator[list[str]]:
    """Nodes a test takes down (`Testbed.node_down`) come back afterwards, whatever happened."""
    down: list[str] = []
    yield down
    for node in down:
        testbed.node_up(node)
