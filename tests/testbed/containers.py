"""Container nodes for the testbed: the node agent runs a pod's container from its image, with podman and runc.

`scripts/testbed.sh up --containers` starts the agent with `--containers`; its nodes then run every pod as a real
container (no kubelet: see docs/development.md, "Container nodes", for why). What a kubelet does and this does too:

- the image from the runtime's store only (images reach it the way `kind load docker-image` loads a node:
  `scripts/testbed.sh load-images`; nothing is pulled: a missing image leaves the pod waiting in ErrImageNeverPull),
  `command`/`args` over the image's ENTRYPOINT/CMD by the kubelet's rules, `$(VAR)` expanded, env incl. the
  downward API and the `kubernetes` Service variables;
- securityContext, pod and container level merged: runAsUser/runAsGroup, fsGroup and supplementalGroups as the
  process's groups, runAsNonRoot checked against the user the container would run as, readOnlyRootFilesystem
  (no tmpfs slipped under /tmp), capabilities add/drop, allowPrivilegeEscalation: false as no_new_privs,
  privileged, seccomp RuntimeDefault (the runtime's profile) or Unconfined;
- limits.memory as the memory limit of a pod-level cgroup (cgroup v1: the kernel OOM-kills inside it and an
  eventfd on memory.oom_control tells the agent, which reports `OOMKilled`; cgroup v2: the container's limit and
  the runtime's OOM flag), limits.cpu as a CFS quota;
- volumes as mounts: emptyDir a pod folder (0777, the fsGroup's), `medium: Memory` a tmpfs of sizeLimit (at
  /dev/shm the container's shm), configMap/secret/projected as read-only files (0644, group fsGroup), a PVC the
  host folder of its PV's hostPath as it is (the kubelet manages no ownership of hostPath volumes), else a folder
  of the agent's with the pod's fsGroup applied as the kubelet does for a CSI volume (group owner + setgid, group
  rw; with fsGroupChangePolicy OnRootMismatch only when its root does not match), hostPath as is;
- the termination message file (a host file bind-mounted at terminationMessagePath), the grace period (SIGTERM to
  the container's main process, SIGKILL at its end), status with `containerID: podman://<id>` and
  `imageID: <repo>@sha256:<digest>`, readiness probes (tcpSocket, httpGet) before `ready: true`.

Not done: pod networking. Every container shares the host's network (as `hostNetwork: true`): the pod IP is the
host's address, Service names resolve to the host through the agent's env mapping, and two pods listening on
one port collide. Liveness/startup probes, init containers, several containers per pod, ephemeral-storage limits
and image pulls are not done either.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.testbed.node_agent import Agent, Proc

LOG = logging.getLogger("testbed.containers")
RUNTIME = "podman"
TESTBED_LABEL = "seqtrain.dev/testbed"
POD_UID_LABEL = "io.kubernetes.pod.uid"
POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_NS_LABEL = "io.kubernetes.pod.namespace"
CGROOT = Path("/sys/fs/cgroup")
CGPARENT = "seqtrain-testbed"


def host_ip() -> str:
    """The host's own address: the pod IP of a host-network pod (the API rejects loopback endpoint addresses)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        return str(s.getsockname()[0])
    return "127.0.0.1"


def _limit_args() -> list[str]:
    """This process's own limits: the runtime's defaults raise RLIMIT_NOFILE/NPROC, which fails without
    CAP_SYS_RESOURCE (as on this VM)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    # NPROC: 32768 (larger values failed on the CI VM even where they did not raise its limit): scripts/images.sh
    return ["--ulimit", f"nofile={-1 if soft == inf else soft}:{-1 if hard == inf else hard}",
            "--ulimit", "nproc=32768:32768"]


def _na() -> Any:
    """The node agent's module: `tests.testbed.node_agent` when imported as a package (the unit tests), else the
    script's folder's `node_agent` (scripts/testbed.sh runs tests/testbed/node_agent.py as a script)."""
    try:
        from tests.testbed import node_agent
    except ImportError:
        import node_agent  # type: ignore[no-redef]
    return node_agent


# ---- pure parts: what the kubelet would do, as podman arguments -------------------------------------------------


def merged_security(pod_spec: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, Any]:
    """The container's effective securityContext: the container's fields over the pod's (the kubelet's rule)."""
    pod_sc = pod_spec.get("securityContext") or {}
    c_sc = container.get("securityContext") or {}
    out = {k: pod_sc[k] for k in ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile") if k in pod_sc}
    out.update(c_sc)
    return out


def entry_args(container: Mapping[str, Any], env: Mapping[str, str]) -> tuple[list[str] | None, list[str] | None]:
    """(entrypoint, args) for the runtime: command replaces the image's ENTRYPOINT (and drops its CMD), args replace
    CMD; None keeps the image's. $(VAR) references are expanded with the container's env."""
    expand_refs = _na().expand_refs
    command = [expand_refs(a, env) for a in container.get("command") or []] or None
    args = [expand_refs(a, env) for a in container.get("args") or []]
    if command is not None:
        return command, args
    return None, (args or None)


def security_args(sc: Mapping[str, Any], groups: list[int], image_user: str) -> list[str]:
    """podman flags for an effective securityContext. Raises ValueError like the kubelet's
    CreateContainerConfigError when runAsNonRoot cannot hold."""
    uid = sc.get("runAsUser")
    user = image_user or "0"
    name, _, group = user.partition(":")
    if uid is None:
        if sc.get("runAsNonRoot"):
            if not name.isdigit():
                raise ValueError(f"container has runAsNonRoot and image has non-numeric user ({name}), "
                                 "cannot verify user is non-root")
            if int(name) == 0:
                raise ValueError("container has runAsNonRoot and image will run as root")
    elif uid == 0 and sc.get("runAsNonRoot"):
        raise ValueError("container's runAsUser breaks non-root policy")
    gid = sc.get("runAsGroup")
    out: list[str] = []
    if uid is not None or gid is not None:
        u = str(uid) if uid is not None else name
        g = str(gid) if gid is not None else (group or ("0" if uid is not None else ""))
        out += ["--user", f"{u}:{g}" if g else u]
    for g in groups:
        out += ["--group-add", str(g)]
    if sc.get("readOnlyRootFilesystem"):
        out += ["--read-only", "--read-only-tmpfs=false"]
    if sc.get("privileged"):
        out.append("--privileged")
    caps = sc.get("capabilities") or {}
    for c in caps.get("drop") or []:
        out += ["--cap-drop", str(c)]
    for c in caps.get("add") or []:
        out += ["--cap-add", str(c)]
    if sc.get("allowPrivilegeEscalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out += ["--security-opt", "seccomp=unconfined"]
    return out


def apply_fs_group(path: Path, gid: int, policy: str | None) -> None:
    """The kubelet's volume ownership: group owner fsGroup, group read/write, setgid on folders (new files keep
    the group). OnRootMismatch: nothing when the root already matches."""
    st = path.stat()
    if policy == "OnRootMismatch" and st.st_gid == gid and st.st_mode & 0o2070 == 0o2070:
        return
    for p in [path, *path.rglob("*")]:
        with contextlib.suppress(FileNotFoundError):
            if p.is_symlink():
                continue
            os.chown(p, -1, gid)
            mode = p.stat().st_mode
            mode |= 0o060 | (0o2010 if p.is_dir() else 0)
            os.chmod(p, mode & 0o7777)


# ---- the runtime ------------------------------------------------------------------------------------------------


class PodmanRuntime:
    """Runs pods' containers with `podman run` (runc), attached: the agent's Proc.popen is that process, and
    its exit code is the container's."""

    def __init__(self, state: Path, podman: str = "podman", oci_runtime: str = "runc") -> None:
        self.state = state
        self.podman = podman
        self.oci_runtime = oci_runtime
        self.tag = hashlib.sha256(str(state).encode()).hexdigest()[:12]  # this testbed's containers
        self.ip = host_ip()
        self.v1 = (CGROOT / "memory" / "memory.limit_in_bytes").exists()
        self.oom_fds: dict[str, tuple[int, int]] = {}

    # -- images --
    def image(self, ref: str) -> dict[str, Any] | None:
        got = subprocess.run([self.podman, "image", "inspect", ref], capture_output=True, text=True)
        if got.returncode != 0:
            return None
        return dict(json.loads(got.stdout)[0])

    # -- cgroups --
    def pod_cgroup(self, uid: str) -> str:
        return f"/{CGPARENT}/pod{uid}"

    def make_pod_cgroup(self, uid: str, mem_limit: int | None) -> None:
        """cgroup v1: the pod's memory cgroup with its limit, and an eventfd counting its OOM kills."""
        if not self.v1:
            return
        cg = CGROOT / "memory" / CGPARENT / f"pod{uid}"
        cg.mkdir(parents=True, exist_ok=True)
        if mem_limit is not None:
            (cg / "memory.limit_in_bytes").write_text(str(mem_limit))
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        ofd = os.open(cg / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        (cg / "cgroup.event_control").write_text(f"{efd} {ofd}")
        self.oom_fds[uid] = (efd, ofd)

    def oom_events(self, uid: str) -> int:
        fds = self.oom_fds.get(uid)
        if fds is None:
            return 0
        try:
            return os.eventfd_read(fds[0])
        except BlockingIOError:
            return 0

    def drop_pod_cgroup(self, uid: str) -> None:
        for fd in self.oom_fds.pop(uid, ()):
            with contextlib.suppress(OSError):
                os.close(fd)
        if not self.v1:
            return
        for ctl in CGROOT.iterdir():
            pod = ctl / CGPARENT / f"pod{uid}"
            if not pod.is_dir():
                continue
            for d in sorted((p for p in pod.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                pod.rmdir()

    # -- pods --
    def start(self, agent: Agent, pod: dict[str, Any]) -> None:
        Proc, container_status, now, pod_conditions, quantity_bytes = attrgetter("Proc", "container_status", "now", "pod_conditions", "quantity_bytes")(_na())

        meta, spec = pod["metadata"], pod["spec"]
        c = spec["containers"][0]
        uid = meta["uid"]
        agent.patch_status(pod, {"phase": "Pending", "hostIP": self.ip, "startTime": now(),
                                 "conditions": pod_conditions(False), "containerStatuses": [container_status(
                                     c, {"waiting": {"reason": "ContainerCreating"}}, False, False)]})
        info = self.image(c.get("image", ""))
        if info is None:
            agent.procs[uid] = None  # type: ignore[assignment]
            agent.patch_status(pod, {"containerStatuses": [container_status(c, {"waiting": {
                "reason": "ErrImageNeverPull", "message": f"image {c.get('image')!r} is not in the node's store: "
                "`make images` then `scripts/testbed.sh load-images` (nothing is pulled here)"}}, False, False)]})
            LOG.warning("pod %s/%s: image %s not loaded", meta["namespace"], meta["name"], c.get("image"))
            return
        try:
            argv, root, message_file = self.prepare(agent, pod, info)
        except Exception as e:  # noqa: BLE001 (the kubelet's CreateContainerConfigError)
            LOG.warning("pod %s/%s cannot start: %s", meta["namespace"], meta["name"], e)
            agent.procs[uid] = None  # type: ignore[assignment]
            agent.patch_status(pod, {"phase": "Pending", "containerStatuses": [container_status(
                c, {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}, False, False)]})
            return
        limits = (c.get("resources") or {}).get("limits") or {}
        mem = quantity_bytes(limits.get("memory"))
        self.make_pod_cgroup(uid, mem)
        log = root / "container.log"
        cid_file = root / "cid"
        cid_file.unlink(missing_ok=True)
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        started = now()
        proc = Proc(uid, popen, log, message_file, c.get("terminationMessagePolicy") or "File", None, started,
                    extra={"node": spec["nodeName"], "container": self.name(pod), "ready": False})
        agent.procs[uid] = proc
        cid = self.wait_cid(cid_file, popen)
        digest = info.get("Digest") or info["Id"]
        repo = (c.get("image") or "").rsplit(":", 1)[0] if "@" not in c.get("image", "") else c["image"].split("@")[0]
        proc.extra["ids"] = {"containerID": f"{RUNTIME}://{cid}" if cid else "",
                             "imageID": f"{repo}@{digest}" if digest.startswith("sha256:") else digest}
        LOG.info("pod %s/%s: container %s started: %s", meta["namespace"], meta["name"], cid[:12], " ".join(argv))
        self.report_running(agent, pod, proc)

    def wait_cid(self, cid_file: Path, popen: subprocess.Popen[bytes]) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if cid_file.exists() and (text := cid_file.read_text().strip()):
                return text
            if popen.poll() is not None:
                return cid_file.read_text().strip() if cid_file.exists() else ""
            time.sleep(0.1)
        return ""

    def report_running(self, agent: Agent, pod: dict[str, Any], proc: Proc) -> None:
        container_status, pod_conditions = attrgetter("container_status", "pod_conditions")(_na())

        c = pod["spec"]["containers"][0]
        ready = bool(proc.extra.get("ready"))
        status = container_status(c, {"running": {"startedAt": proc.started_at}}, ready, True, ids=proc.extra["ids"])
        agent.patch_status(pod, {"phase": "Running", "podIP": self.ip, "podIPs": [{"ip": self.ip}],
                                 "hostIP": self.ip, "hostIPs": [{"ip": self.ip}], "conditions": pod_conditions(ready),
                                 "containerStatuses": [status]})

    def tick(self, agent: Agent, pod: dict[str, Any], proc: Proc) -> None:
        """A running container: ready once its readiness probe passes (no probe: at once, as the kubelet)."""
        if proc.extra.get("ready"):
            return
        c = pod["spec"]["containers"][0]
        if self.probe(c, c.get("readinessProbe")):
            proc.extra["ready"] = True
            self.report_running(agent, pod, proc)

    def probe(self, c: Mapping[str, Any], probe: Mapping[str, Any] | None) -> bool:
        if not probe:
            return True
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}

        def port_of(p: Any) -> int:
            return int(ports[p]) if isinstance(p, str) and not p.isdigit() else int(p)
        try:
            if "tcpSocket" in probe:
                with socket.create_connection((self.ip, port_of(probe["tcpSocket"]["port"])), timeout=1):
                    return True
            if "httpGet" in probe:
                g = probe["httpGet"]
                scheme = (g.get("scheme") or "HTTP").lower()
                url = f"{scheme}://{self.ip}:{port_of(g['port'])}{g.get('path', '/')}"
                import ssl

                ctx = ssl._create_unverified_context()  # noqa: S323 (the kubelet skips verification too)
                with urllib.request.urlopen(url, timeout=1, context=ctx) as r:  # noqa: S310
                    return 200 <= r.status < 400
        except (OSError, KeyError, ValueError):
            return False
        return True  # exec probes are not run here

    def on_exit(self, proc: Proc) -> None:
        """The container is gone: was it the kernel's OOM killer?"""
        uid = proc.uid
        if self.v1:
            proc.oom = proc.oom or self.oom_events(uid) > 0
        else:
            got = subprocess.run([self.podman, "inspect", "--format", "{{.State.OOMKilled}}", proc.extra["container"]],
                                 capture_output=True, text=True)
            proc.oom = proc.oom or got.stdout.strip() == "true"

    def kill(self, proc: Proc, sig: int) -> None:
        """A signal to the container's main process (the kubelet's StopContainer: SIGTERM, then SIGKILL)."""
        if proc.popen.poll() is not None:
            return  # exited: nothing left to signal
        subprocess.run([self.podman, "kill", "--signal", signal.Signals(sig).name, proc.extra["container"]],
                       capture_output=True)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=30)

    def remove(self, uid: str, proc: Proc | None) -> None:
        if proc is not None and "container" in proc.extra:
            subprocess.run([self.podman, "rm", "-f", "-t", "0", proc.extra["container"]], capture_output=True)
        self.drop_pod_cgroup(uid)

    def remove_all(self) -> None:
        """Every container of this testbed (an agent that was SIGKILLed leaves them running)."""
        got = subprocess.run([self.podman, "ps", "-aq", "--filter", f"label={TESTBED_LABEL}={self.tag}"],
                             capture_output=True, text=True)
        ids = got.stdout.split()
        if ids:
            subprocess.run([self.podman, "rm", "-f", "-t", "0", *ids], capture_output=True)
        for uid in list(self.oom_fds):
            self.drop_pod_cgroup(uid)

    def name(self, pod: Mapping[str, Any]) -> str:
        meta = pod["metadata"]
        c = pod["spec"]["containers"][0]
        return f"k8s_{c['name']}_{meta['name']}_{meta['namespace']}_{meta['uid']}_0"

    def prepare(self, agent: Agent, pod: dict[str, Any], info: Mapping[str, Any]) -> tuple[list[str], Path, Path]:
        """Volumes on the host, then the `podman run` argv. Raises ValueError when the kubelet would refuse."""
        PathMap, container_env, quantity_bytes, service_env = attrgetter("PathMap", "container_env", "quantity_bytes", "service_env")(_na())

        meta, spec = pod["metadata"], pod["spec"]
        ns, uid = meta["namespace"], meta["uid"]
        containers = spec.get("containers") or []
        if len(containers) != 1 or spec.get("initContainers"):
            raise ValueError("the testbed agent runs pods of exactly one container and no init containers")
        c = containers[0]
        root = agent.state / "pods" / uid
        root.mkdir(parents=True, exist_ok=True)
        pod_sc = spec.get("securityContext") or {}
        fs_group = pod_sc.get("fsGroup")
        fs_policy = pod_sc.get("fsGroupChangePolicy")
        mounts: list[str] = []
        by_name: dict[str, tuple[str, Any]] = {}  # volume -> ("bind", host path) | ("tmpfs", size bytes)
        for v in spec.get("volumes") or []:
            local = root / "volumes" / v["name"]
            if "configMap" in v or "secret" in v or "projected" in v:
                local.mkdir(parents=True, exist_ok=True)
                if "projected" in v:
                    files = [f for src in v["projected"].get("sources") or [] for f in agent._projection(pod, src)]
                else:
                    kind = "configmap" if "configMap" in v else "secret"
                    src = v.get("configMap") or v.get("secret")
                    data = agent._data(kind, ns, src.get("name") or src.get("secretName"))
                    if data is None:
                        if not src.get("optional"):
                            raise ValueError(f"volume {v['name']}: {kind} {src.get('name') or src.get('secretName')}"
                                             " not found")
                        data = {}
                    items = src.get("items") or [{"key": k, "path": k} for k in data]
                    files = [(it["path"], data.get(it["key"], "")) for it in items]
                for path, text in files:
                    f = local / path
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_text(text)
                    os.chmod(f, 0o644)
                    if fs_group is not None:
                        os.chown(f, -1, int(fs_group))
                os.chmod(local, 0o755)
                by_name[v["name"]] = ("bind", local)
            elif "emptyDir" in v:
                ed = v["emptyDir"] or {}
                if ed.get("medium") == "Memory":
                    size = quantity_bytes(ed.get("sizeLimit"))
                    by_name[v["name"]] = ("tmpfs", size)
                    continue
                local.mkdir(parents=True, exist_ok=True)
                os.chmod(local, 0o777)
                if fs_group is not None:
                    apply_fs_group(local, int(fs_group), None)
                by_name[v["name"]] = ("bind", local)
            elif "persistentVolumeClaim" in v:
                local = agent._claim_dir(ns, v["persistentVolumeClaim"]["claimName"])
                local.mkdir(parents=True, exist_ok=True)
                # A hostPath PV is mounted as it is (the kubelet manages no ownership there: hence the README's
                # chmod 0777); a claim without one is a folder of the agent's, owned like a CSI volume's.
                if fs_group is not None and local.is_relative_to(agent.state):
                    apply_fs_group(local, int(fs_group), fs_policy)
                by_name[v["name"]] = ("bind", local)
            elif "hostPath" in v:
                by_name[v["name"]] = ("bind", Path(v["hostPath"]["path"]))
            else:
                raise ValueError(f"volume {v['name']}: kind {sorted(set(v) - {'name'})} not supported by the agent")
        shm_done = False
        for m in c.get("volumeMounts") or []:
            if m["name"] not in by_name:
                raise ValueError(f"volumeMount {m['name']}: no such volume")
            kind, what = by_name[m["name"]]
            if kind == "tmpfs":
                opts = f"type=tmpfs,destination={m['mountPath']}" + (f",tmpfs-size={what}" if what else "")
                mounts += ["--mount", opts + ",tmpfs-mode=1777"]
                shm_done = shm_done or m["mountPath"].rstrip("/") == "/dev/shm"
                continue
            src = Path(what) / m["subPath"] if m.get("subPath") else Path(what)
            ro = ",ro=true" if m.get("readOnly") else ""
            mounts += ["--mount", f"type=bind,source={src},destination={m['mountPath']}{ro}"]
        message_file = root / "termination-log"
        message_file.write_text("")
        os.chmod(message_file, 0o666)
        mounts += ["--mount", f"type=bind,source={message_file},"
                              f"destination={c.get('terminationMessagePath') or '/dev/termination-log'}"]
        env = container_env(pod, c, agent.lookup(ns), PathMap({}))
        for item in c.get("env") or []:  # the pod IP of a host-network pod is the host's
            ref = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
            if ref in ("status.podIP", "status.hostIP", "status.podIPs", "status.hostIPs"):
                env[item["name"]] = self.ip
        if agent.server:
            env = {**service_env(agent.server), **env}
        sc = merged_security(spec, c)
        groups = [int(g) for g in pod_sc.get("supplementalGroups") or []]
        if fs_group is not None:
            groups.insert(0, int(fs_group))
        config = info.get("Config") or {}
        argv = [self.podman, "run", "--runtime", self.oci_runtime, "--name", self.name(pod),
                "--cidfile", str(root / "cid"), "--network", "host", "--pull", "never", "--log-driver", "none",
                "--label", f"{TESTBED_LABEL}={self.tag}", "--label", f"{POD_UID_LABEL}={uid}",
                "--label", f"{POD_NAME_LABEL}={meta['name']}", "--label", f"{POD_NS_LABEL}={ns}",
                "--stop-timeout", "0", *_limit_args()]
        argv += security_args(sc, groups, str(config.get("User") or ""))
        if self.v1:
            argv += ["--cgroup-parent", self.pod_cgroup(uid)]
        limits = (c.get("resources") or {}).get("limits") or {}
        if not self.v1 and limits.get("memory"):
            argv += ["--memory", str(quantity_bytes(limits["memory"]))]
        if limits.get("cpu"):
            cpu = str(limits["cpu"])
            argv += ["--cpus", str(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
        if not shm_done:
            argv += ["--shm-size", "64m"]  # the runtime's default, as containerd's
        if c.get("workingDir"):
            argv += ["--workdir", c["workingDir"]]
        for k, v in env.items():
            argv += ["--env", f"{k}={v}"]
        argv += mounts
        entrypoint, args = entry_args(c, env)
        if entrypoint is not None:
            argv += ["--entrypoint", json.dumps(entrypoint)]
        argv.append(c["image"])
        if args is not None:
            argv += args
        elif entrypoint is not None:
            pass  # command without args: the image's CMD is dropped
        return argv, root, message_file
