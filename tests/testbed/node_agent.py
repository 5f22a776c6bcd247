"""A kubelet for tests: runs the real container commands of pods bound to its nodes as local processes.

`scripts/testbed.sh up` starts it next to a real control plane; kwok handles every other node. For each pod bound
to one of its nodes it does what the kubelet documentation says a kubelet does, within one machine:

- registers its nodes and keeps them alive (NodeReady condition + a Lease in kube-node-lease, renewed every few
  seconds); a node marked down (`testbed.sh node-down NODE` drops a file in <state>/down/) stops both and its pod
  processes are SIGKILLed: nothing on that node answers again, so deletions there are never confirmed;
- runs the pod's containers: `command` + `args` with the pod's env ($(VAR) references expanded, fieldRef
  metadata.name/namespace/uid, spec.nodeName, status.podIP/hostIP, configMapKeyRef and secretKeyRef resolved), in
  its own process group. Volumes become local folders (configMap/secret keys written out, emptyDir per pod, a PVC
  the hostPath of its PV, else a folder per claim, `medium: Memory` at /dev/shm is the host's /dev/shm). A process
  cannot see a pod's mount paths, so each mountPath is rewritten to its local folder in the argv, the env values
  and the configMap/secret files (a config file that names /checkpoints/... then names the folder); a Service host
  name (`*.svc`, `*.svc.cluster.local`) in an env value becomes 127.0.0.1, the pod IP of every pod here;
- reports status like a kubelet: Pending (ContainerCreating; held that many seconds for a pod annotated
  testbed.seqtrain.dev/start-delay-seconds, as a large image pull or a volume attach holds it) -> Running (podIP, startTime, containerStatuses
  started/ready, Ready conditions) -> terminated with exitCode, reason Completed / Error / OOMKilled (the
  process group's resident memory passed limits.memory and the agent killed it, as the kernel's OOM killer does
  in a cgroup), and the termination message: the terminationMessagePath file (mapped into the pod folder), or
  with FallbackToLogsOnError and a failure, the log's last 80 lines / 2048 bytes;
- honours deletion: SIGTERM to the process group, SIGKILL after the pod's grace period
  (metadata.deletionGracePeriodSeconds), and only when the processes are gone confirms with a delete of grace 0
  (with the pod's uid as precondition), as the kubelet does; a pod annotated
  testbed.seqtrain.dev/ignore-deletion=true is left Terminating (a wedged kubelet) until it is force-deleted.

Containers beside the first (a sidecar, an injected proxy) run as processes of their own, as the kubelet runs them:
native sidecars (init containers with `restartPolicy: Always`) start first, are listed in initContainerStatuses
and get SIGTERM once every regular container has exited; the pod stays Running while any regular container runs,
then ends Succeeded if all of them exited 0, else Failed. Other init containers are not run (refused).
restartPolicy Never only (the operator's pods; the operator restarts whole gangs): an exited container stays
terminated. The image, securityContext and resource limits other than memory are not enforced: every pod runs
as this user with this Python environment (PATH and PYTHONPATH are passed through). With `--containers`
(`scripts/testbed.sh up --containers`) they are enforced: every pod runs as a real container from its image
(tests/testbed/containers.py; this module keeps the API side: nodes, status, deletion, node-down).

Lives in tests/ (not in a shipped package): it is test infrastructure, imported by its unit test and started by
scripts/testbed.sh as `python tests/testbed/node_agent.py`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOG = logging.getLogger("testbed.agent")
POD_IP = "127.0.0.1"
AGENT_LABEL = "seqtrain.dev/testbed-agent"
HEARTBEAT_S = 4.0
POLL_S = 1.0
MESSAGE_LIMIT = 4096          # kubelet: the termination message is at most 4096 bytes
FALLBACK_LINES, FALLBACK_BYTES = 80, 2048  # FallbackToLogsOnError: the smaller of 80 lines / 2048 bytes
_SVC_HOST = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?\.svc(\.cluster\.local)?\.?$")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---- pure parts: quantities, env, paths, status ----------------------------------------------------------------

_BIN = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DEC = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": 10**-3}


def quantity_bytes(q: str | int | None) -> int | None:
    """A Kubernetes memory quantity in bytes ("1Gi", "500M", "1e9", 1024); None stays None."""
    if q is None:
        return None
    text = str(q).strip()
    for suffix, mult in {**_BIN, **_DEC}.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(float(text))


def expand_refs(text: str, env: Mapping[str, str]) -> str:
    """$(VAR) -> the value of an earlier env var (kept as-is when undefined); $$ -> $ (the kubelet's rules)."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR_REF.sub(sub, text)


class PathMap:
    """mountPath -> local folder, longest first, applied as path prefixes in strings."""

    def __init__(self, mounts: Mapping[str, str]) -> None:
        self.mounts = {k.rstrip("/") or "/": v for k, v in mounts.items()}
        alts = "|".join(re.escape(k) for k in sorted(self.mounts, key=len, reverse=True) if k != "/")
        # A mount path only counts where a path starts (not inside another word or path) and ends.
        self._re = re.compile(rf"(?<![\w./-])({alts})(?=/|$|[\s\"',:;=)\]}}])") if alts else None

    def rewrite(self, text: str) -> str:
        if self._re is None:
            return text
        return self._re.sub(lambda m: self.mounts[m.group(1)], text)


def resolve_field(pod: Mapping[str, Any], path: str) -> str:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": POD_IP,
              "status.hostIP": POD_IP, "status.podIPs": POD_IP, "status.hostIPs": POD_IP}
    if path in simple:
        return str(simple[path] or "")
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise ValueError(f"fieldRef {path!r} is not supported by the testbed agent")


def container_env(pod: Mapping[str, Any], container: Mapping[str, Any],
                  lookup: Callable[[str, str, str], str | None], paths: PathMap) -> dict[str, str]:
    """The container's env as the kubelet builds it, then mount paths and Service host names mapped locally.

    `lookup(kind, name, key)` reads a configMap/secret key (None: missing)."""
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item or "valueFrom" not in item:
            value = expand_refs(str(item.get("value", "")), env)
        else:
            src = item["valueFrom"]
            if "fieldRef" in src:
                value = resolve_field(pod, src["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in src or "secretKeyRef" in src:
                kind = "configmap" if "configMapKeyRef" in src else "secret"
                ref = src.get("configMapKeyRef") or src.get("secretKeyRef")
                got = lookup(kind, ref["name"], ref["key"])
                if got is None:
                    if ref.get("optional"):
                        continue
                    raise ValueError(f"env {name}: {kind} {ref['name']} has no key {ref['key']}")
                value = got
            elif "resourceFieldRef" in src:
                value = "1"  # no cgroup here: a divisor-scaled limit would be made up; 1 is a valid count
            else:
                raise ValueError(f"env {name}: valueFrom {sorted(src)} is not supported by the testbed agent")
        env[name] = value
    out = {}
    for k, v in env.items():
        out[k] = POD_IP if _SVC_HOST.match(v) else paths.rewrite(v)
    return out


def service_env(server: str) -> dict[str, str]:
    """What the kubelet sets in every container for the `kubernetes` Service, here the apiserver's own address (with
    a mounted service-account token, in-cluster clients then reach the API as the pod's ServiceAccount)."""
    u = urllib.parse.urlsplit(server)
    host, port = u.hostname or "127.0.0.1", str(u.port or 443)
    return {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port, "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://{host}:{port}"}


def fallback_message(log_tail: bytes) -> str:
    lines = log_tail.splitlines(keepends=True)[-FALLBACK_LINES:]
    return b"".join(lines)[-FALLBACK_BYTES:].decode("utf-8", "replace")


def terminated_state(exit_code: int, oom: bool, message: str, started: str, finished: str,
                     signalled: int | None = None) -> dict[str, Any]:
    """The containerStatus `state.terminated` of a finished process (a signal death reads as 128+signal)."""
    code = 128 + signalled if signalled else exit_code
    reason = "OOMKilled" if oom else ("Completed" if code == 0 else "Error")
    out: dict[str, Any] = {"exitCode": code, "reason": reason, "startedAt": started, "finishedAt": finished}
    if signalled:
        out["signal"] = signalled
    if message:
        out["message"] = message[:MESSAGE_LIMIT]
    return out


# Test-only: a pod with this annotation stays ContainerCreating for that many seconds before it starts.
START_DELAY = "testbed.seqtrain.dev/start-delay-seconds"
# Test-only: a deleted pod with this annotation ("true") stays Terminating: the agent neither signals its processes
# nor confirms the deletion, as a wedged kubelet or container runtime does. Only a force delete (grace 0) ends it.
IGNORE_DELETION = "testbed.seqtrain.dev/ignore-deletion"


def pod_conditions(ready: bool, initialized: bool = True) -> list[dict[str, Any]]:
    t = now()
    cond = [("PodReadyToStartContainers", initialized), ("Initialized", initialized), ("Ready", ready),
            ("ContainersReady", ready), ("PodScheduled", True)]
    out = []
    for kind, ok in cond:
        c = {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": t, "lastProbeTime": None}
        if not ok and kind in ("Ready", "ContainersReady"):
            c["reason"] = "ContainersNotReady" if initialized else "PodCompleted"
        out.append(c)
    return out


def container_status(container: Mapping[str, Any], state: dict[str, Any], ready: bool, started: bool,
                     restart_count: int = 0, ids: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`ids`: a real container's containerID and imageID (container nodes, tests/testbed/containers.py)."""
    return {"name": container["name"], "image": container.get("image", ""), "imageID": "",
            "containerID": f"testbed://{container['name']}", "ready": ready, "started": started,
            "restartCount": restart_count, "state": state, **(ids or {})}


# ---- the running side -------------------------------------------------------------------------------------------


@dataclass
class Proc:
    """One pod's container process and what the status needs about it."""

    uid: str
    popen: subprocess.Popen[bytes]
    log: Path
    message_file: Path
    policy: str
    mem_limit: int | None
    started_at: str
    term_sent: float | None = None
    kill_at: float | None = None
    oom: bool = False
    reported: bool = False
    finished_at: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def group_memory(pgid: int) -> int:
    """Bytes the process group holds, each page counted once: the sum of its processes' proportional set sizes
    (a shared page split among the processes mapping it), as a memory cgroup charges a page once. Summed RSS would
    count torch's shared libraries and the launcher's pages in every process and OOM-kill a pod a kubelet keeps."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            total += _pss(entry) or int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def _pss(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def companions(spec: Mapping[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    """The containers besides the first, each with whether it is a native sidecar (an init container with
    restartPolicy Always, started before the others) or a regular container."""
    return [*((c, True) for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"),
            *((c, False) for c in (spec.get("containers") or [])[1:])]


def signal_pod(proc: Proc, sig: int, reap: bool = False) -> None:
    """`sig` to the process groups of every container of the pod (`reap`: and wait for them)."""
    for p in [proc, *proc.extra.get("companions", [])]:
        kill_group(p.popen.pid, sig)
        if reap:
            p.popen.wait()


class Agent:
    """Owns `nodes`; polls the API for their pods and runs them. All API calls go through `api` (CoreV1Api)."""

    def __init__(self, api: Any, coord: Any, nodes: Iterable[str], state: Path, labels: Mapping[str, str],
                 capacity: Mapping[str, str], server: str | None = None, runtime: Any = None) -> None:
        self.api, self.coord = api, coord
        self.runtime = runtime  # containers.PodmanRuntime on container nodes; None: pods are local processes
        self.server = server  # the apiserver's URL, for the kubelet's KUBERNETES_SERVICE_* env (None: not set)
        self.nodes = list(nodes)
        self.state = state
        self.labels = dict(labels)
        self.capacity = dict(capacity)
        self.procs: dict[str, Proc] = {}
        self.creating: dict[str, float] = {}  # pod uid -> when it entered ContainerCreating (START_DELAY)
        self.ignored: set[str] = set()  # uids of deleted pods left Terminating (IGNORE_DELETION), logged once
        self.down: set[str] = set()
        self.stop = threading.Event()
        self.log_port: int | None = None  # kubelet_logs.LogServer's port (main() starts it): pods/log works
        (state / "down").mkdir(parents=True, exist_ok=True)
        (state / "pods").mkdir(parents=True, exist_ok=True)

    # -- nodes --
    def register(self) -> None:
        from kubernetes.client.rest import ApiException

        for name in self.nodes:
            body = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": {**self.labels, "kubernetes.io/hostname": name,
                                                          AGENT_LABEL: "true"}}}
            try:
                self.api.create_node(body)
            except ApiException as e:
                if e.status != 409:
                    raise
                self.api.patch_node(name, {"metadata": {"labels": body["metadata"]["labels"]}})
            self.heartbeat(name, first=True)

    def heartbeat(self, name: str, first: bool = False) -> None:
        from kubernetes.client.rest import ApiException

        t = now()
        conds = [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "testbed agent is posting "
                  "ready status", "lastHeartbeatTime": t, "lastTransitionTime": t}]
        for kind, reason in (("MemoryPressure", "KubeletHasSufficientMemory"),
                             ("DiskPressure", "KubeletHasNoDiskPressure"), ("PIDPressure", "KubeletHasSufficientPID")):
            conds.append({"type": kind, "status": "False", "reason": reason, "lastHeartbeatTime": t,
                          "lastTransitionTime": t})
        status: dict[str, Any] = {"conditions": conds}
        if first:
            status |= {"capacity": self.capacity, "allocatable": self.capacity,
                       "addresses": [{"type": "InternalIP", "address": POD_IP}, {"type": "Hostname", "address": name}],
                       "nodeInfo": {"kubeletVersion": "v1.36.1-testbed", "kubeProxyVersion": "", "osImage": "testbed",
                                    "operatingSystem": "linux", "architecture": "amd64",
                                    "containerRuntimeVersion": "testbed://1", "kernelVersion": os.uname().release,
                                    "machineID": name, "systemUUID": name, "bootID": name}}
            if self.log_port:
                status["daemonEndpoints"] = {"kubeletEndpoint": {"Port": self.log_port}}
        else:
            # Keep lastTransitionTime when Ready already was True (a merge patch replaces the whole list).
            node = self.api.read_node_status(name)
            prev = {c.type: c for c in (node.status.conditions or [])}
            for c in conds:
                p = prev.get(c["type"])
                if p is not None and p.status == c["status"] and p.last_transition_time is not None:
                    c["lastTransitionTime"] = p.last_transition_time.strftime("%Y-%m-%dT%H:%M:%SZ")
        self.api.patch_node_status(name, {"status": status})
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": name, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now_micro()}}
        try:
            self.coord.patch_namespaced_lease(name, "kube-node-lease", {"spec": lease["spec"]})
        except ApiException as e:
            if e.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", lease)

    def heartbeat_loop(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            for name in self.nodes:
                if name in self.down:
                    continue
                try:
                    self.heartbeat(name)
                except Exception as e:  # noqa: BLE001 (an apiserver restart must not end the heartbeats)
                    LOG.warning("heartbeat %s: %s", name, e)

    def check_down(self) -> None:
        marked = {p.name for p in (self.state / "down").iterdir()}
        for name in self.nodes:
            if name in marked and name not in self.down:
                LOG.info("node %s down: heartbeats stop, its processes are killed", name)
                self.down.add(name)
                for proc in self.procs.values():
                    if proc is not None and proc.extra.get("node") == name:
                        # Killed with the node; reported (exit 137) only if the node comes back, like a kubelet
                        # that restarts and finds its containers gone.
                        self.kill(proc, signal.SIGKILL, reap=True)
            elif name not in marked and name in self.down:
                LOG.info("node %s up again", name)
                self.down.discard(name)
                self.heartbeat(name)

    def log_of(self, namespace: str, name: str, container: str) -> tuple[Path, Callable[[], bool]] | tuple[int, str]:
        """For kubelet_logs.LogServer: the log file of a container of one of our pods and whether its process still
        runs, or (HTTP status, the kubelet's message)."""
        from kubelet_logs import container_log
        from kubernetes.client.rest import ApiException

        try:
            pod = json.loads(self.api.read_namespaced_pod(name, namespace, _preload_content=False).data)
        except ApiException as e:
            return (404, f'pods "{name}" not found') if e.status == 404 else (500, str(e.reason))
        names = [c["name"] for c in pod["spec"].get("containers") or []]
        if container not in names + [c["name"] for c, _ in companions(pod["spec"])]:
            return 400, f"container {container} is not valid for pod {name}"
        uid = pod["metadata"]["uid"]
        path = container_log(self.state / "pods" / uid, container, names[0])
        if not path.exists():
            return 400, f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'

        def running() -> bool:
            proc = self.procs.get(uid)
            return proc is not None and proc.popen.poll() is None

        return path, running

    # -- pods --
    def lookup(self, namespace: str) -> Callable[[str, str, str], str | None]:
        def get(kind: str, name: str, key: str) -> str | None:
            data = self._data(kind, namespace, name)
            return None if data is None else data.get(key)
        return get

    def _data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        from kubernetes.client.rest import ApiException

        try:
            if kind == "configmap":
                cm = self.api.read_namespaced_config_map(name, namespace)
                return dict(cm.data or {})
            sec = self.api.read_namespaced_secret(name, namespace)
            return {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (sec.data or {}).items()}
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _projection(self, pod: dict[str, Any], src: dict[str, Any]) -> list[tuple[str, str]]:
        """(path, content) of one projected volume source, as the kubelet would write it."""
        meta = pod["metadata"]
        if "serviceAccountToken" in src:
            t = src["serviceAccountToken"]
            spec: dict[str, Any] = {"expirationSeconds": t.get("expirationSeconds", 3607),
                                    "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                                       "uid": meta["uid"]}}
            if t.get("audience"):
                spec["audiences"] = [t["audience"]]
            sa = pod["spec"].get("serviceAccountName") or "default"
            got = self.api.create_namespaced_service_account_token(sa, meta["namespace"], {"spec": spec})
            return [(t["path"], got.status.token)]
        if "downwardAPI" in src:
            return [(it["path"], resolve_field(pod, it["fieldRef"]["fieldPath"]))
                    for it in src["downwardAPI"].get("items") or [] if "fieldRef" in it]
        kind = "configmap" if "configMap" in src else "secret"
        ref = src.get("configMap") or src.get("secret") or {}
        data = self._data(kind, meta["namespace"], ref.get("name", ""))
        if data is None:
            if ref.get("optional"):
                return []
            raise ValueError(f"projected {kind} {ref.get('name')} not found")
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        return [(it["path"], data.get(it["key"], "")) for it in items]

    def _claim_dir(self, namespace: str, claim: str) -> Path:
        pvc = self.api.read_namespaced_persistent_volume_claim(claim, namespace)
        if pvc.spec.volume_name:
            pv = self.api.read_persistent_volume(pvc.spec.volume_name)
            if pv.spec.host_path is not None:
                return Path(pv.spec.host_path.path)
        return self.state / "volumes" / namespace / claim

    def prepare(self, pod: dict[str, Any], c: dict[str, Any] | None = None
                ) -> tuple[list[str], dict[str, str], Path, Path, str]:
        """Volumes -> folders, then the argv and env of container `c` (default: the first). Raises ValueError when
        it cannot."""
        meta, spec = pod["metadata"], pod["spec"]
        ns, uid = meta["namespace"], meta["uid"]
        root = self.state / "pods" / uid
        root.mkdir(parents=True, exist_ok=True)
        containers = spec.get("containers") or []
        if not containers or any(i.get("restartPolicy") != "Always" for i in spec.get("initContainers") or []):
            raise ValueError("the testbed agent runs no init containers other than native sidecars "
                             "(restartPolicy: Always)")
        c = c or containers[0]
        if not c.get("command"):
            raise ValueError(f"container {c['name']}: no command (the image's entrypoint is unknown here)")
        volumes: dict[str, Path] = {}
        files: list[Path] = []
        for v in spec.get("volumes") or []:
            local = root / "volumes" / v["name"]
            if "configMap" in v or "secret" in v:
                kind = "configmap" if "configMap" in v else "secret"
                src = v.get("configMap") or v.get("secret")
                data = self._data(kind, ns, src.get("name") or src.get("secretName"))
                if data is None:
                    if src.get("optional"):
                        data = {}
                    else:
                        raise ValueError(f"volume {v['name']}: {kind} not found")
                local.mkdir(parents=True, exist_ok=True)
                items = src.get("items") or [{"key": k, "path": k} for k in data]
                for it in items:
                    f = local / it["path"]
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_text(data.get(it["key"], ""))
                    files.append(f)
            elif "projected" in v:  # e.g. kube-api-access-*: a bound token, the cluster CA, the namespace
                local.mkdir(parents=True, exist_ok=True)
                for src in v["projected"].get("sources") or []:
                    for path, text in self._projection(pod, src):
                        f = local / path
                        f.parent.mkdir(parents=True, exist_ok=True)
                        f.write_text(text)
            elif "emptyDir" in v:
                local = Path("/dev/shm") if (v["emptyDir"] or {}).get("medium") == "Memory" and any(
                    m["name"] == v["name"] and m["mountPath"] == "/dev/shm" for m in c.get("volumeMounts") or []) else local
                local.mkdir(parents=True, exist_ok=True)
            elif "persistentVolumeClaim" in v:
                local = self._claim_dir(ns, v["persistentVolumeClaim"]["claimName"])
                local.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in v:
                local = Path(v["hostPath"]["path"])
            else:
                raise ValueError(f"volume {v['name']}: kind {sorted(set(v) - {'name'})} not supported by the agent")
            volumes[v["name"]] = local
        mounts: dict[str, str] = {}
        for m in c.get("volumeMounts") or []:
            base = volumes[m["name"]]
            target = base / m["subPath"] if m.get("subPath") else base
            if str(target) != m["mountPath"]:
                mounts[m["mountPath"]] = str(target)
        message_file = root / ("termination-log" if c is containers[0] else f"termination-log.{c['name']}")
        message_file.write_text("")
        mounts[c.get("terminationMessagePath") or "/dev/termination-log"] = str(message_file)
        paths = PathMap(mounts)
        for f in files:  # a config file naming a mount path names its local folder
            f.write_text(paths.rewrite(f.read_text()))
        env = container_env(pod, c, self.lookup(ns), paths)
        # The trainer writes its final progress to the termination-message file; here that file is a local one.
        env.setdefault("SEQTRAIN_TERMINATION_LOG", str(message_file))
        argv = [paths.rewrite(expand_refs(a, env)) for a in [*(c.get("command") or []), *(c.get("args") or [])]]
        cwd = paths.rewrite(c["workingDir"]) if c.get("workingDir") else str(root)
        return argv, env, root, message_file, cwd

    def kill_main(self, proc: Proc, sig: int) -> None:
        """`sig` to the pod's first container: through the runtime on container nodes, else its process group."""
        if self.runtime is not None and "container" in proc.extra:
            if proc.popen.poll() is None:
                self.runtime.kill(proc, sig)
        else:
            kill_group(proc.popen.pid, sig)

    def kill(self, proc: Proc, sig: int, reap: bool = False) -> None:
        """`sig` to every container of the pod (`reap`: and wait for them)."""
        if self.runtime is not None and "container" in proc.extra:
            self.kill_main(proc, sig)
            if reap:
                proc.popen.wait()
        else:
            signal_pod(proc, sig, reap)

    def start(self, pod: dict[str, Any]) -> None:
        if self.runtime is not None:
            self.runtime.start(self, pod)
            return
        meta = pod["metadata"]
        c = pod["spec"]["containers"][0]
        self.patch_status(pod, {"phase": "Pending", "hostIP": POD_IP, "startTime": now(),
                                "conditions": pod_conditions(False),
                                "containerStatuses": [container_status(
                                    c, {"waiting": {"reason": "ContainerCreating"}}, False, False)]})
        try:
            # Companions first: a configMap file shared with the first container ends up with its mount paths.
            side = [(sc, native, self.prepare(pod, sc)) for sc, native in companions(pod["spec"])]
            for sc, _, prep in side:
                if shutil.which(prep[0][0], path=prep[1].get("PATH") or os.environ.get("PATH")) is None:
                    raise ValueError(f"container {sc['name']}: exec: {prep[0][0]!r}: executable file not found")
            argv, env, root, message_file, cwd = self.prepare(pod)
        except Exception as e:  # noqa: BLE001 (the pod fails with the reason, like CreateContainerConfigError)
            LOG.warning("pod %s/%s cannot start: %s", meta["namespace"], meta["name"], e)
            self.patch_status(pod, {"phase": "Pending", "containerStatuses": [container_status(
                c, {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}, False, False)]})
            self.procs[meta["uid"]] = None  # type: ignore[assignment]  # tried; never again
            return
        base = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "LANG", "OMP_NUM_THREADS", "VIRTUAL_ENV")
                if k in os.environ}
        if self.server:
            base.update(service_env(self.server))
        log = root / "container.log"
        exe = shutil.which(argv[0], path=env.get("PATH") or base.get("PATH"))
        if exe is None:
            self.finish_without_start(pod, 127, f"exec: {argv[0]!r}: executable file not found in $PATH")
            return
        started_side = []
        for sc, native, (s_argv, s_env, _, s_message, s_cwd) in side:  # native sidecars start before the rest
            with open(root / f"container.{sc['name']}.log", "ab") as out:
                s_popen = subprocess.Popen([shutil.which(s_argv[0], path=s_env.get("PATH") or base.get("PATH")),
                                            *s_argv[1:]], env={**base, **s_env}, cwd=s_cwd, stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            (root / f"pgid.{sc['name']}").write_text(str(s_popen.pid))
            started_side.append(Proc(meta["uid"], s_popen, root / f"container.{sc['name']}.log", s_message,
                                     "File", None, now(), extra={"container": sc, "native": native}))
        with open(log, "ab") as out:
            popen = subprocess.Popen([exe, *argv[1:]], env={**base, **env}, cwd=cwd, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        (root / "pgid").write_text(str(popen.pid))  # `testbed.sh down` kills what a SIGKILLed agent left
        limits = ((c.get("resources") or {}).get("limits") or {})
        started = now()
        proc = Proc(meta["uid"], popen, log, message_file, c.get("terminationMessagePolicy") or "File",
                    quantity_bytes(limits.get("memory")), started,
                    extra={"node": pod["spec"]["nodeName"], "companions": started_side})
        self.procs[meta["uid"]] = proc
        LOG.info("pod %s/%s: started pid %d: %s", meta["namespace"], meta["name"], popen.pid, " ".join(argv))
        self.patch_status(pod, self.with_companions(proc, {
            "phase": "Running", "podIP": POD_IP, "podIPs": [{"ip": POD_IP}], "hostIP": POD_IP,
            "hostIPs": [{"ip": POD_IP}], "conditions": pod_conditions(True),
            "containerStatuses": [container_status(c, {"running": {"startedAt": started}}, True, True)]}))

    def finish_without_start(self, pod: dict[str, Any], code: int, message: str) -> None:
        c = pod["spec"]["containers"][0]
        t = now()
        self.procs[pod["metadata"]["uid"]] = None  # type: ignore[assignment]
        self.patch_status(pod, {"phase": "Failed", "conditions": pod_conditions(False, True), "containerStatuses": [
            container_status(c, {"terminated": terminated_state(code, False, message, t, t)}, False, False)]})

    def exit_state(self, proc: Proc) -> dict[str, Any]:
        """state.terminated of the first container, its termination message included."""
        if self.runtime is not None and "container" in proc.extra:
            self.runtime.on_exit(proc)
        rc = proc.popen.returncode
        signalled = -rc if rc < 0 else None
        message = proc.message_file.read_text(errors="replace") if proc.message_file.exists() else ""
        if not message.strip() and proc.policy == "FallbackToLogsOnError" and (rc != 0 or proc.oom):
            with open(proc.log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
                message = fallback_message(f.read())
        proc.finished_at = proc.finished_at or now()
        return terminated_state(rc if rc >= 0 else 0, proc.oom, message, proc.started_at, proc.finished_at,
                                signalled)

    def report_exit(self, pod: dict[str, Any], proc: Proc) -> None:
        state = self.exit_state(proc)
        regular = [s for s in proc.extra.get("companions", []) if not s.extra["native"]]
        phase = "Succeeded" if state["exitCode"] == 0 and all(s.popen.returncode == 0 for s in regular) else "Failed"
        c = pod["spec"]["containers"][0]
        self.patch_status(pod, self.with_companions(proc, {
            "phase": phase, "conditions": pod_conditions(False),
            "containerStatuses": [container_status(c, {"terminated": state}, False, False,
                                                   ids=proc.extra.get("ids"))]}))
        proc.reported = True
        LOG.info("pod %s/%s: exited %s (%s)", pod["metadata"]["namespace"], pod["metadata"]["name"],
                 state["exitCode"], state["reason"])

    def with_companions(self, proc: Proc, status: dict[str, Any]) -> dict[str, Any]:
        """`status` with the states of the other containers: regular ones after the first in containerStatuses,
        native sidecars in initContainerStatuses."""
        regular, native = [], []
        for s in proc.extra.get("companions", []):
            rc = s.popen.poll()
            if rc is None:
                state: dict[str, Any] = {"running": {"startedAt": s.started_at}}
            else:
                s.finished_at = s.finished_at or now()
                state = {"terminated": terminated_state(max(rc, 0), False, "", s.started_at, s.finished_at,
                                                        -rc if rc < 0 else None)}
            (native if s.extra["native"] else regular).append(
                container_status(s.extra["container"], state, rc is None, rc is None))
        out = {**status, "containerStatuses": [*status.get("containerStatuses", []), *regular]}
        if native:
            out["initContainerStatuses"] = native
        return out

    def report_companions(self, pod: dict[str, Any], proc: Proc, first: dict[str, Any]) -> None:
        """A companion exited (the first container in state `first`): the pod's phase stays, its status says so."""
        done = [s for s in proc.extra.get("companions", []) if not s.reported and s.popen.poll() is not None]
        if done:
            for s in done:
                s.reported = True
            c = pod["spec"]["containers"][0]
            self.patch_status(pod, self.with_companions(proc, {"containerStatuses": [container_status(
                c, first, "running" in first, "running" in first)]}))

    def companions_running(self, pod: dict[str, Any], proc: Proc) -> bool:
        """The first container exited: the pod stays Running while another regular container runs (the exit
        shows in its containerStatus); then native sidecars get SIGTERM (SIGKILL after the grace period)."""
        side = proc.extra.get("companions", [])
        if any(not s.extra["native"] and s.popen.poll() is None for s in side):
            if not proc.extra.get("exit_shown"):
                proc.extra["exit_shown"] = True
                state = self.exit_state(proc)
                c = pod["spec"]["containers"][0]
                self.patch_status(pod, self.with_companions(proc, {"containerStatuses": [container_status(
                    c, {"terminated": state}, False, False)]}))
            return True
        running = [s for s in side if s.popen.poll() is None]
        for s in running:
            if s.term_sent is None:
                s.term_sent = time.monotonic()
                s.kill_at = s.term_sent + float(pod["spec"].get("terminationGracePeriodSeconds", 30))
                kill_group(s.popen.pid, signal.SIGTERM)
            elif time.monotonic() >= (s.kill_at or 0):
                kill_group(s.popen.pid, signal.SIGKILL)
        return bool(running)

    def patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.api.patch_namespaced_pod_status(pod["metadata"]["name"], pod["metadata"]["namespace"],
                                                 {"status": status})
        except ApiException as e:
            if e.status != 404:  # gone already: nothing to report
                raise

    def confirm_deletion(self, pod: dict[str, Any]) -> None:
        from kubernetes.client import V1DeleteOptions, V1Preconditions
        from kubernetes.client.rest import ApiException

        meta = pod["metadata"]
        try:
            self.api.delete_namespaced_pod(meta["name"], meta["namespace"], body=V1DeleteOptions(
                grace_period_seconds=0, preconditions=V1Preconditions(uid=meta["uid"])))
        except ApiException as e:
            if e.status not in (404, 409):
                raise
        LOG.info("pod %s/%s: deletion confirmed", meta["namespace"], meta["name"])

    def sync_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        proc = self.procs.get(uid)
        phase = (pod.get("status") or {}).get("phase")
        if proc is not None and proc.popen.poll() is not None and proc.finished_at is None:
            proc.finished_at = now()
        if meta.get("deletionTimestamp"):
            if (meta.get("annotations") or {}).get(IGNORE_DELETION) == "true":
                if uid not in self.ignored:
                    self.ignored.add(uid)
                    LOG.info("pod %s/%s: deletion ignored (%s)", meta["namespace"], meta["name"], IGNORE_DELETION)
                return
            if proc is not None and any(p.popen.poll() is None for p in [proc, *proc.extra.get("companions", [])]):
                if proc.term_sent is None:
                    grace = meta.get("deletionGracePeriodSeconds")
                    grace = pod["spec"].get("terminationGracePeriodSeconds", 30) if grace is None else grace
                    proc.term_sent = time.monotonic()
                    proc.kill_at = proc.term_sent + float(grace)
                    LOG.info("pod %s/%s: SIGTERM (grace %ss)", meta["namespace"], meta["name"], grace)
                    self.kill(proc, signal.SIGTERM)
                elif time.monotonic() >= (proc.kill_at or 0):
                    self.kill(proc, signal.SIGKILL)
                return
            if proc is not None:
                self.kill(proc, signal.SIGKILL)  # stragglers of the groups
                if not proc.reported:
                    self.report_exit(pod, proc)
            self.confirm_deletion(pod)
            self.forget(uid)
            return
        if proc is None and uid not in self.procs:
            if phase in ("Succeeded", "Failed"):
                self.procs[uid] = None  # type: ignore[assignment]  # finished before this agent started
                return
            if self.still_creating(pod):
                return
            self.start(pod)
            return
        if proc is None:
            return
        if proc.popen.poll() is None:
            if self.runtime is not None and "container" in proc.extra:
                self.runtime.tick(self, pod, proc)  # the kernel enforces its memory limit
                return
            if proc.mem_limit is not None and (used := group_memory(proc.popen.pid)) > proc.mem_limit:
                LOG.info("pod %s/%s: %d bytes, over its memory limit %d: OOM kill", meta["namespace"], meta["name"],
                         used, proc.mem_limit)
                proc.oom = True
                kill_group(proc.popen.pid, signal.SIGKILL)
            self.report_companions(pod, proc, {"running": {"startedAt": proc.started_at}})
            return
        self.kill_main(proc, signal.SIGKILL)  # a dead container leaves no process behind
        if not proc.reported and not self.companions_running(pod, proc):
            self.report_exit(pod, proc)

    def still_creating(self, pod: dict[str, Any]) -> bool:
        """A pod annotated START_DELAY stays ContainerCreating that long (a large image being pulled, a volume
        being attached), as a kubelet reports it, before its containers start."""
        delay = float((pod["metadata"].get("annotations") or {}).get(START_DELAY) or 0)
        if delay <= 0:
            return False
        uid = pod["metadata"]["uid"]
        if uid not in self.creating:
            self.creating[uid] = time.monotonic()
            self.patch_status(pod, {"phase": "Pending", "hostIP": POD_IP, "startTime": now(),
                                    "conditions": pod_conditions(False),
                                    "containerStatuses": [container_status(
                                        pod["spec"]["containers"][0], {"waiting": {"reason": "ContainerCreating"}},
                                        False, False)]})
        return time.monotonic() - self.creating[uid] < delay

    def forget(self, uid: str) -> None:
        self.creating.pop(uid, None)
        self.ignored.discard(uid)
        proc = self.procs.pop(uid, None)
        if self.runtime is not None:
            self.runtime.remove(uid, proc)
        shutil.rmtree(self.state / "pods" / uid, ignore_errors=True)

    def sync(self) -> None:
        self.check_down()
        seen: set[str] = set()
        for name in self.nodes:
            if name in self.down:
                continue
            pods = self.api.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={name}",
                                                        _preload_content=False)
            for pod in json.loads(pods.data)["items"]:
                seen.add(pod["metadata"]["uid"])
                try:
                    self.sync_pod(pod)
                except Exception as e:  # noqa: BLE001 (one pod must not stop the others)
                    LOG.warning("pod %s/%s: %s", pod["metadata"]["namespace"], pod["metadata"]["name"], e)
        for uid, proc in list(self.procs.items()):  # deleted behind our back (force delete): kill, forget
            if uid not in seen and (proc is None or proc.extra.get("node") not in self.down):
                if proc is not None:
                    self.kill(proc, signal.SIGKILL, reap=True)
                self.forget(uid)

    def run(self) -> None:
        self.register()
        beat = threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        while not self.stop.is_set():
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 (apiserver hiccups: try again next round)
                LOG.warning("sync: %s", e)
            self.stop.wait(POLL_S)
        self.shutdown()

    def shutdown(self) -> None:
        for proc in self.procs.values():
            if proc is not None:
                self.kill(proc, signal.SIGKILL, reap=True)
        if self.runtime is not None:
            self.runtime.remove_all()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--state", required=True, help="folder for pod folders, volumes and node-down marks")
    p.add_argument("--node", action="append", required=True, help="a node this agent owns (repeatable)")
    p.add_argument("--label", action="append", default=[], help="KEY=VALUE on every node (repeatable)")
    p.add_argument("--capacity", default="cpu=4,memory=8Gi,pods=110,ephemeral-storage=50Gi")
    p.add_argument("--containers", action="store_true",
                   help="run pods as containers from their images (podman + runc: tests/testbed/containers.py)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from kubernetes import client, config

    config.load_kube_config(args.kubeconfig)
    runtime = None
    if args.containers:
        from containers import PodmanRuntime

        runtime = PodmanRuntime(Path(args.state).resolve())
    agent = Agent(client.CoreV1Api(), client.CoordinationV1Api(), args.node, Path(args.state).resolve(),
                  dict(kv.split("=", 1) for kv in args.label), dict(kv.split("=", 1) for kv in args.capacity.split(",")),
                  server=client.Configuration.get_default_copy().host, runtime=runtime)
    from kubelet_logs import LogServer

    logs = LogServer(agent.log_of, agent.state, agent.stop)
    logs.start()
    agent.log_port = logs.port
    signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stop.set())
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
