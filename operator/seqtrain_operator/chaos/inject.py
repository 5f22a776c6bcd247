"""The chaos soak's injectors: one method per fault kind of chaos.schedule, acting on the test control plane
(scripts/testbed.sh), the node agent's pod processes, the fault proxy in front of the operator, the operator
process and the checkpoint volume. Each returns what it hit (jobs, and a one-line target) or raises `Skip` when no
candidate exists at that moment (logged as skipped, not counted as injected)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seqtrain_operator.chaos.schedule import Event

AGENT_NODES = ("cpu-0", "cpu-1")


class Skip(Exception):
    """No candidate for this event now (e.g. no running trainer job, a node already down)."""


NAN_TRIGGER = "chaos-nan-loss"  # in the job's folder on the checkpoint volume (SEQTRAIN_FAULT_NAN_FILE)


@dataclass
class Hit:
    jobs: list[str]
    target: str
    detail: dict[str, Any] = field(default_factory=dict)


def children(pid: int) -> list[int]:
    """Live child processes of `pid`, oldest first."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] not in ("Z", "X"):
            out.append((int(stat[19]), int(entry.name)))  # starttime, pid
    return [p for _, p in sorted(out)]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def waiting_spare(pid: int) -> bool:
    """A spare rank the launcher started ahead of an in-place restart still waits for its start order: it holds
    the standby pipe (SEQTRAIN_STANDBY_FD in its initial environment) open until then."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    fd = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SEQTRAIN_STANDBY_FD=")), None)
    return fd is not None and fd.isdigit() and os.path.exists(f"/proc/{pid}/fd/{fd}")


def rank_pids(launcher: int) -> list[int]:
    """The training processes of a pod: the rank processes its launcher (the pod's process-group leader) started,
    each in a session of its own, and not a spare waiting for an in-place restart (it holds no rank yet)."""
    return [p for p in children(launcher) if "seqtrain.train.entry" in cmdline(p) and not waiting_spare(p)]


@dataclass
class Injector:
    """`world` is the runner: it knows the running jobs, their pods, the operator and the proxy."""

    world: Any
    tb_dir: Path
    script: Path
    timers: list[tuple[float, str, Callable[[], None]]] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)
    down: set[str] = field(default_factory=set)
    filler: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def later(self, delay: float, what: str, fn: Callable[[], None]) -> None:
        with self.lock:
            self.timers.append((time.monotonic() + delay, what, fn))

    def due(self) -> list[tuple[str, Callable[[], None]]]:
        now = time.monotonic()
        with self.lock:
            ready = [(w, f) for t, w, f in self.timers if t <= now]
            self.timers = [x for x in self.timers if x[0] > now]
        return ready

    def heal(self) -> list[str]:
        """Undo what is still in force (end of the soak): every timer now, stopped ranks continued, nodes up."""
        done = []
        with self.lock:
            pending, self.timers = self.timers, []
        for what, fn in ((w, f) for _, w, f in pending):
            with contextlib.suppress(Exception):
                fn()
            done.append(what)
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self.stopped.discard(pid)
        for node in list(self.down):
            self._node_up(node)
        self.world.proxy.clear_rules()
        return done

    def fire(self, ev: Event) -> Hit:
        return getattr(self, "_" + ev.kind.replace("-", "_"))(ev)

    # ---- ranks and pods ------------------------------------------------------------------------------------

    def _pick_rank(self, ev: Event) -> tuple[str, dict[str, Any], int]:
        """(job, pod, rank pid) of a running trainer job's pod."""
        pods = [(job, pod) for job, pod in self.world.trainer_pods() if pod.get("pgid")]
        if not pods:
            raise Skip("no running trainer pod")
        job, pod = pods[ev.pick % len(pods)]
        ranks = rank_pids(pod["pgid"])
        if not ranks:
            raise Skip(f"pod {pod['name']} has no rank process")
        return job, pod, ranks[(ev.pick // 7) % len(ranks)]

    def _sigkill_rank(self, ev: Event) -> Hit:
        job, pod, pid = self._pick_rank(ev)
        os.kill(pid, signal.SIGKILL)
        return Hit([job], f"{pod['name']} pid {pid}")

    def _nan_loss(self, ev: Event) -> Hit:
        """The job's rank 0 makes its next micro-batch's loss NaN (it watches for this file: chaos.bench sets
        SEQTRAIN_FAULT_NAN_FILE in every trainer job): the step is skipped, the job goes on."""
        job, pod, _ = self._pick_rank(ev)
        trigger = self.world.volume / job / NAN_TRIGGER
        trigger.parent.mkdir(parents=True, exist_ok=True)
        trigger.touch()
        return Hit([job], f"{pod['name']} ({NAN_TRIGGER})")

    def _sigstop_rank(self, ev: Event) -> Hit:
        job, pod, pid = self._pick_rank(ev)
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        cont = ev.params.get("cont_after")
        if cont is not None:
            def resume() -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                self.stopped.discard(pid)
            self.later(cont, f"SIGCONT {pid}", resume)
        return Hit([job], f"{pod['name']} pid {pid}", {"cont_after": cont})

    def _pick_pod(self, ev: Event) -> tuple[str, dict[str, Any]]:
        pods = self.world.running_pods()
        if not pods:
            raise Skip("no running pod")
        return pods[ev.pick % len(pods)]

    def _delete_pod(self, ev: Event) -> Hit:
        from kubernetes import client
        job, pod = self._pick_pod(ev)
        try:
            self.world.core.delete_namespaced_pod(pod["name"], pod["namespace"])
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            raise Skip(f"{pod['name']} went before it could be deleted") from None
        return Hit([job], pod["name"])

    def _evict_pod(self, ev: Event) -> Hit:
        from kubernetes import client
        job, pod = self._pick_pod(ev)
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod["name"], namespace=pod["namespace"]))
        try:
            self.world.core.create_namespaced_pod_eviction(pod["name"], pod["namespace"], body)
        except client.ApiException as exc:  # a disruption budget may refuse it (429): logged, not injected
            raise Skip(f"eviction of {pod['name']} refused: {exc.status} {exc.reason}") from None
        return Hit([job], pod["name"])

    # ---- nodes ---------------------------------------------------------------------------------------------

    def _node_down(self, ev: Event) -> Hit:
        if self.down:
            raise Skip(f"{sorted(self.down)[0]} is down already (one agent node at a time keeps a place to run)")
        node = AGENT_NODES[ev.pick % len(AGENT_NODES)]
        return Hit(self._take_down(node, ev.params["up_after"]), node, {"up_after": ev.params["up_after"]})

    def _take_down(self, node: str, up_after: float) -> list[str]:
        jobs = sorted({job for job, pod in self.world.all_pods() if pod.get("node") == node})
        subprocess.run([str(self.script), "node-down", node], check=True, capture_output=True, timeout=60)
        self.down.add(node)
        self.later(up_after, f"node-up {node}", lambda: self._node_up(node))
        return jobs

    def _node_up(self, node: str) -> None:
        subprocess.run([str(self.script), "node-up", node], check=False, capture_output=True, timeout=60)
        self.down.discard(node)
        self.world.node_up(node)

    def _sigterm_node_loss(self, ev: Event) -> Hit:
        if self.down:
            raise Skip(f"{sorted(self.down)[0]} is down already")
        pods = [(job, pod) for job, pod in self.world.trainer_pods() if pod.get("node") in AGENT_NODES]
        if not pods:
            raise Skip("no running trainer pod")
        job, pod = pods[ev.pick % len(pods)]
        self.world.core.delete_namespaced_pod(pod["name"], pod["namespace"])  # SIGTERM: the ranks save
        time.sleep(ev.params["loss_after"])
        jobs = self._take_down(pod["node"], ev.params["up_after"])
        return Hit(sorted(set(jobs) | {job}), f"{pod['name']} on {pod['node']}", dict(ev.params))

    # ---- the operator and its API traffic ------------------------------------------------------------------

    def _operator_kill(self, ev: Event) -> Hit:
        self.world.restart_operator(graceful=False)
        return Hit([], "operator (SIGKILL)")

    def _operator_restart(self, ev: Event) -> Hit:
        self.world.restart_operator(graceful=True)
        return Hit([], "operator (SIGTERM)")

    def _api_5xx(self, ev: Event) -> Hit:
        self.world.proxy.add_rule("*", r"/", status=ev.params["status"], times=ev.params["times"])
        return Hit([], "operator's next requests", dict(ev.params))

    def _api_429(self, ev: Event) -> Hit:
        self.world.proxy.add_rule("*", r"/", status=429, times=ev.params["times"], retry_after=ev.params["retry_after"])
        return Hit([], "operator's next requests", dict(ev.params))

    def _api_slow(self, ev: Event) -> Hit:
        self.world.proxy.add_rule("*", r"/", watch=False, delay=ev.params["delay"], times=ev.params["times"])
        return Hit([], "operator's next requests", dict(ev.params))

    def _watch_cut(self, ev: Event) -> Hit:
        return Hit([], f"{self.world.proxy.drop_watches()} watch streams")

    def _watch_gone(self, ev: Event) -> Hit:
        self.world.proxy.add_rule("GET", r"/", gone=True, times=1)
        return Hit([], f"{self.world.proxy.drop_watches()} watch streams cut, the next one 410 Gone")

    # ---- the checkpoint volume -----------------------------------------------------------------------------

    def _checkpoint_full(self, ev: Event) -> Hit:
        volume = self.world.volume
        if not self.world.volume_is_tmpfs:
            raise Skip("the checkpoint volume is no filesystem of its own (not root: no tmpfs)")
        if self.filler is not None:
            raise Skip("the volume is full already")
        st = os.statvfs(volume)
        free = st.f_bavail * st.f_frsize
        self.filler = volume / ".chaos-filler"
        with open(self.filler, "wb") as f, contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, max(free - 4096, 0))

        def empty() -> None:
            if self.filler is not None:
                self.filler.unlink(missing_ok=True)
                self.filler = None
        self.later(ev.params["for_s"], "checkpoint volume freed", empty)
        return Hit(sorted({job for job, _ in self.world.trainer_pods()}), "checkpoint volume", {"for_s": ev.params["for_s"],
                                                                                      "filled_bytes": free})

    def _checkpoint_corrupt(self, ev: Event) -> Hit:
        jobs = sorted({job for job, _ in self.world.trainer_pods()})
        candidates = [(j, s) for j in jobs if len(s := self.world.checkpoints(j)) >= 2]
        if not candidates:
            raise Skip("no running trainer job with two checkpoints")
        job, steps = candidates[ev.pick % len(candidates)]
        newest = max(steps)
        folder = self.world.volume / job / "checkpoints" / f"step-{newest}"
        garbled = 0
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            with contextlib.suppress(OSError), open(path, "r+b") as f:
                size = path.stat().st_size
                f.seek(size // 2)
                f.write(os.urandom(min(64, max(size - size // 2, 1))))
                garbled += 1
        self.world.checker.corrupted(job, newest)
        # Kill a rank so the gang resumes now, from the newest checkpoint it can load.
        pods = [pod for j, pod in self.world.trainer_pods() if j == job and pod.get("pgid")]
        killed = None
        for pod in pods:
            ranks = rank_pids(pod["pgid"])
            if ranks:
                os.kill(ranks[0], signal.SIGKILL)
                killed = f"{pod['name']} pid {ranks[0]}"
                break
        return Hit([job], f"{folder.name} ({garbled} files)", {"step": newest, "then_killed": killed})
