"""The external gang schedulers on the testbed, shared by their tests and by `seqtrain bench operator --kueue`:
where their CRDs and binaries are (scripts/gang-crds.sh, scripts/gang-schedulers.sh), how their processes start and
stop, and Kueue's controller manager with its webhooks pointed at the local process (the testbed has no Service
routing)."""

from __future__ import annotations

import base64
import contextlib
import copy
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from testbed.fixtures import CI, ROOT, TB, Testbed, free_port, unavailable, wait

KUEUE_GATE = "kueue.x-k8s.io/admission"


def crd_files(download: bool = CI) -> dict[str, list[Path]]:
    """The gang schedulers' CRD files by scheduler (`<missing>`/`<error>` say why some are not)."""
    try:
        # CI downloads the modules (once, cached by version); elsewhere only what is cached is used
        out = subprocess.run([str(ROOT / "scripts" / "gang-crds.sh"), *([] if download else ["--check"])],
                             capture_output=True, text=True, timeout=600 if download else 60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"<error>": [Path(str(exc))]}
    files = {}
    for line in out.stdout.splitlines():
        name, _, paths = line.partition("=")
        files[name] = [Path(p) for p in paths.split(",")]
    if out.returncode != 0:
        files["<missing>"] = [Path(out.stderr.strip())]
    return files


def install_crds(tb: Testbed, docs: list[dict[str, Any]]) -> None:
    # Server-side apply: Kueue's CRDs are larger than the last-applied annotation client-side apply writes.
    tb.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(docs), timeout=180)
    for d in docs:
        name = d["metadata"]["name"]
        wait(f"CRD {name} Established", lambda n=name: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in ((tb.get("crd", n) or {}).get("status") or {}).get("conditions") or []), 120)


def gang_binaries(name: str) -> Path:
    out = subprocess.run([str(ROOT / "scripts" / "gang-schedulers.sh"), "--check", name], capture_output=True,
                         text=True)
    if out.returncode != 0:
        unavailable(f"{name} not built: run `scripts/gang-schedulers.sh` (one Go build each)")
    return Path(out.stdout.strip())


def start(tb: Testbed, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log = TB / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "KUBECONFIG": str(tb.kubeconfig), **(env or {})},
                                start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def without_v1beta1(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kueue's CRDs with v1beta1 no longer served (v1beta2 stores), as Kueue v0.20 ships them."""
    out = copy.deepcopy(docs)
    for d in out:
        versions = d["spec"]["versions"]
        if {v["name"] for v in versions} >= {"v1beta1", "v1beta2"}:
            for v in versions:
                if v["name"] == "v1beta1":
                    v["served"], v["storage"] = False, False
                elif v["name"] == "v1beta2":
                    v["storage"] = True
    return out


@contextlib.contextmanager
def kueue(tb: Testbed, pod_label: str = "seqtrain.dev/job", files: dict[str, list[Path]] | None = None,
          v1beta1_served: bool = True) -> Iterator[subprocess.Popen[bytes]]:
    """Kueue's controller manager (the pod integration only) with its CRDs and webhooks, running until the block
    ends. Its pod webhooks see only pods that carry the label `pod_label` (the tests' pods, or a benchmark's).
    `v1beta1_served=False`: the CRDs serve v1beta2 only (Kueue v0.20's), restored as shipped when the block ends."""
    bins = gang_binaries("kueue")
    files = crd_files() if files is None else files
    if "kueue" not in files:
        unavailable("no Kueue CRDs: run scripts/gang-crds.sh")
    base = files["kueue"][0].parent
    shipped = [yaml.safe_load(p.read_text()) for p in sorted(base.glob("*.yaml"))]
    install_crds(tb, shipped if v1beta1_served else without_v1beta1(shipped))
    tb.kubectl("create", "namespace", "kueue-system", check=False)
    port = free_port()
    certs = TB / "kueue-certs"
    certs.mkdir(exist_ok=True)
    for src, dst in (("webhook.crt", "tls.crt"), ("webhook.key", "tls.key")):
        (certs / dst).write_bytes((TB / "pki" / src).read_bytes())
    # Kueue's own webhook configurations, pointed at the local process.
    ca = base64.b64encode(tb.ca_pem()).decode()
    hooks = list(yaml.safe_load_all((base.parents[1] / "webhook" / "manifests.yaml").read_text()))
    for doc in hooks:
        doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
        # only what this Kueue serves here: the pod integration and Kueue's own APIs (the others would refuse
        # e.g. every batch Job on the testbed with a 404 from a framework that is not enabled)
        doc["webhooks"] = [w for w in doc.get("webhooks", []) if "-v1-pod" in w["clientConfig"]["service"]["path"]
                           or "kueue-x-k8s-io" in w["clientConfig"]["service"]["path"]]
        for w in doc["webhooks"]:
            path = w["clientConfig"]["service"]["path"]
            w["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
            w.pop("namespaceSelector", None)
            if "/mutate--v1-pod" in path or "/validate--v1-pod" in path:
                w["objectSelector"] = {"matchExpressions": [{"key": pod_label, "operator": "Exists"}]}
    tb.apply(hooks)
    cfg = TB / "kueue-config.yaml"
    cfg.write_text(yaml.safe_dump({
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{free_port()}"},
        "metrics": {"bindAddress": f"127.0.0.1:{free_port()}"},
        "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["pod"]}}))
    # With its own certificate management off, Kueue v0.19 reads the metrics server's certificate from a fixed
    # path (cmd/kueue/main.go); created here only when absent, and removed again.
    metrics_certs = Path("/etc/kueue/metrics/certs")
    created = not metrics_certs.exists()
    if created:
        try:
            metrics_certs.mkdir(parents=True)
        except OSError as exc:
            unavailable(f"Kueue needs {metrics_certs} (its fixed metrics certificate path): {exc}")
        for f in ("tls.crt", "tls.key"):
            (metrics_certs / f).write_bytes((certs / f).read_bytes())
    # its visibility API server wants certificates of its own; nothing here uses it. PriorityBoost (alpha, v0.17+):
    # preemption orders candidates by priority + the Workload's kueue.x-k8s.io/priority-boost, which the operator
    # sets from the work at risk (--kueue-priority-boost-seconds)
    proc = start(tb, [str(bins / "kueue"), f"--config={cfg}",
                      "--feature-gates=VisibilityOnDemand=false,PriorityBoost=true"], "kueue")
    try:
        def serving() -> bool:
            assert proc.poll() is None, (TB / "logs" / "kueue.log").read_text(errors="replace")[-3000:]
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return True
        wait("Kueue's webhook listening", serving, 180)
        yield proc
    finally:
        stop(proc)
        tb.kubectl("delete", "-f", "-", "--ignore-not-found", input=yaml.safe_dump_all(hooks), check=False)
        if not v1beta1_served:
            install_crds(tb, shipped)
        if created:
            for f in ("tls.crt", "tls.key"):
                (metrics_certs / f).unlink(missing_ok=True)
            for d in (metrics_certs, metrics_certs.parent, metrics_certs.parent.parent):
                d.rmdir()
