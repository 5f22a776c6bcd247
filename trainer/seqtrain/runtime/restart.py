"""In-place restarts: the launchers of a gang restart their ranks in the pods they run in, instead of the operator
deleting and re-creating every pod (docs/architecture.md, "In-place restart").

Torch-free, like the launcher. The launcher of NODE_RANK 0 hosts a tiny coordination service (`Coordinator`, JSON
lines over TCP on SEQTRAIN_RESTART_PORT); every launcher, its own included, holds one connection to it (`Peer`).

The protocol, one restart "round" at a time (round 0 is the gang's first start):
- a launcher whose local rank failed restartably sends {"fail": round, "code": c} and stops its other ranks;
- the coordinator, if in-place restarts are left, bumps the round and sends every launcher {"restart": round,
  "notBefore": t} (t: the failure + that restart's backoff); each stops its ranks and answers {"ready": round};
- when all launchers are ready (a barrier), it sends {"go": round}: each starts its ranks again with
  SEQTRAIN_RESTART_ROUND=round; they resume from the latest complete checkpoint and start training at t at the
  earliest (torch is imported while the backoff runs);
- it sends {"abort": round, "code": c, "why": text} instead when no in-place restart is left, when a launcher does
  not reach the barrier within SEQTRAIN_RESTART_BARRIER_SECONDS or its connection drops during one (its pod or node
  is lost): then every launcher exits with today's exit code and the operator re-creates the gang.
A launcher that loses its connection to the coordinator (rank 0's pod is gone) falls back to today's behaviour.

SEQTRAIN_INPLACE_DELAYS: the backoff, in seconds, of each in-place restart this gang may make ("2,4": two, after 2
and 4 s); the operator computes it at pod creation from faultTolerance (inPlaceRestarts, the restart budget left,
backoff), so the launchers never spend more than the budget. Unset or empty: no in-place restart (today's
behaviour).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from seqtrain.runtime import exitcodes

DELAYS_ENV = "SEQTRAIN_INPLACE_DELAYS"
PORT_ENV = "SEQTRAIN_RESTART_PORT"
BARRIER_ENV = "SEQTRAIN_RESTART_BARRIER_SECONDS"
ROUND_ENV = "SEQTRAIN_RESTART_ROUND"
STARTED_AT_ENV = "SEQTRAIN_INCARNATION_STARTED_AT"  # epoch seconds the launcher (this incarnation) started
NOT_BEFORE_ENV = "SEQTRAIN_START_NOT_BEFORE"  # wall-clock epoch seconds; ranks start training no earlier
LAUNCHER_PID_ENV = "SEQTRAIN_LAUNCHER_PID"  # the rank's parent (PID 1 in a container: no other test works)
STANDBY_ENV = "SEQTRAIN_STANDBY_FD"  # a spare rank reads its start order (JSON env) from this descriptor
STEPPED_ENV = "SEQTRAIN_STEPPED_FILE"  # a rank creates this file after its first step (`mark_stepped`)
# Stopping a replica's ranks takes up to the launcher's FAILURE_GRACE_SECONDS (SIGTERM -> SIGKILL), so the barrier
# waits longer than that: a launcher that has not come by then has lost its pod or node.
DEFAULT_BARRIER_SECONDS = 30.0
CONNECT_RETRY_SECONDS = 0.2
_MAX_LINE = 4096
# The launcher's last line when it exits non-zero after in-place restarts (its log; in a pod also the termination
# message): the operator charges rounds that no progress report showed (a rank 0 that failed before reporting).
ROUNDS_MARKER = "seqtrain launch: in-place restarts made: "


# ---- pure parts ------------------------------------------------------------------------------------------------


class RestartConfigError(ValueError):
    """A SEQTRAIN_ restart variable is malformed; the message names it. The launcher exits 3 (invalid config)."""


@dataclass(frozen=True)
class InPlace:
    """What the launchers of one gang may do in place: a backoff per allowed restart, the barrier's deadline, the
    coordinator's port and how many launchers (replicas) there are."""

    delays: tuple[float, ...]
    port: int
    barrier_seconds: float
    replicas: int

    @property
    def enabled(self) -> bool:
        return bool(self.delays)


def parse_delays(raw: str) -> tuple[float, ...]:
    """SEQTRAIN_INPLACE_DELAYS ("2,4.5") -> (2.0, 4.5); "" -> () (no in-place restart)."""
    out = []
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise RestartConfigError(f"{DELAYS_ENV}={raw!r}: {part!r} is not a number of seconds") from None
        if not value >= 0:
            raise RestartConfigError(f"{DELAYS_ENV}={raw!r}: delays must be >= 0 seconds")
        out.append(value)
    return tuple(out)


def in_place_from(environ: Mapping[str, str], replicas: int) -> InPlace:
    """The in-place settings of this gang from the launcher's environment (see the module doc)."""
    delays = parse_delays(environ.get(DELAYS_ENV, ""))
    port_raw = environ.get(PORT_ENV, "")
    if not port_raw and delays:
        master = environ.get("MASTER_PORT", "")
        port_raw = str(int(master) + 1) if master.isdigit() else ""
    if delays and not port_raw:
        raise RestartConfigError(f"{PORT_ENV} (or MASTER_PORT) is required when {DELAYS_ENV} is set")
    try:
        port = int(port_raw) if port_raw else 0
        barrier = float(environ.get(BARRIER_ENV) or DEFAULT_BARRIER_SECONDS)
    except ValueError:
        raise RestartConfigError(f"{PORT_ENV} must be an integer and {BARRIER_ENV} a number of seconds") from None
    if delays and not 0 < port < 65536:
        raise RestartConfigError(f"{PORT_ENV}={port} must be a TCP port (1-65535)")
    return InPlace(delays, port, barrier, replicas)


def rounds_in(text: str | None) -> int:
    """The in-place restarts a launcher reported at its exit (ROUNDS_MARKER) in a log tail or termination message."""
    found = 0
    for line in (text or "").splitlines():
        at = line.find(ROUNDS_MARKER)
        if at >= 0:
            with contextlib.suppress(ValueError):
                found = int(line[at + len(ROUNDS_MARKER):].split()[0])
    return found


def in_place_history(environ: Mapping[str, str], now: float) -> tuple[int, float]:
    """(failures, seconds) this incarnation spent before this round: the in-place restarts the launchers made, and
    the wall time since the launcher started. The controller's failure history (the trainer config) is written when
    the pods are created, so a rank restarted in place adds these itself (checkpoint.intervalSteps: auto's MTBF)."""
    raw = environ.get(ROUND_ENV, "")
    rounds = int(raw) if raw.isdigit() else 0
    if rounds == 0:
        return 0, 0.0
    try:
        started = float(environ.get(STARTED_AT_ENV, ""))
    except ValueError:
        return rounds, 0.0
    return rounds, max(0.0, now - started)


def restartable(code: int) -> bool:
    """May a rank that exited `code` be restarted in place? Not success, not an invalid config (permanent), not a
    device fault (the node is broken: only re-creating the pod elsewhere helps). Everything else may be transient."""
    return code not in (exitcodes.OK, exitcodes.INVALID_CONFIG, exitcodes.DEVICE_UNAVAILABLE)


@dataclass
class Barrier:
    """The coordinator's state, no I/O: feed it what launchers say and the clock, it answers the messages to
    broadcast. round: the current restart round; waiting: launchers still to reach the barrier of `round`."""

    plan: InPlace
    round: int = 0
    deadline: float | None = None  # while a barrier is open
    waiting: set[int] = field(default_factory=set)
    connected: set[int] = field(default_factory=set)
    left: set[int] = field(default_factory=set)  # connected once, then dropped: the pod stopped or is lost
    aborted: bool = False
    cause: int = exitcodes.ERROR
    announced: dict[str, Any] | None = None  # the open round's restart message

    def join(self, node: int) -> list[dict[str, Any]]:
        """A launcher connected; the messages for it alone (the open round's order: it connected late)."""
        self.connected.add(node)
        self.left.discard(node)
        return [self.announced] if self.deadline is not None and self.announced is not None else []

    def leave(self, node: int, now: float) -> list[dict[str, Any]]:
        """A launcher's connection dropped: its pod stopped or is lost. During a barrier it can never come."""
        self.connected.discard(node)
        self.left.add(node)
        if self.deadline is not None and node in self.waiting:
            return self._abort(f"replica {node} disconnected during in-place restart {self.round} (pod stopped or "
                               "lost)")
        return []

    def fail(self, node: int, at_round: int, code: int, now: float) -> list[dict[str, Any]]:
        if self.aborted or at_round != self.round or self.deadline is not None:
            return []  # an echo of the failure already being handled (or a stale round)
        self.cause = code
        if self.round >= len(self.plan.delays):
            return self._abort(f"replica {node} failed with exit code {code} and the {len(self.plan.delays)} "
                               "in-place restart(s) allowed are used up")
        if self.left:  # (one not connected YET still may: it gets the order when it does, or misses the deadline)
            return self._abort(f"replica {node} failed with exit code {code}; replica(s) {sorted(self.left)} "
                               "disconnected (pod stopped or lost), so the gang cannot restart in place")
        self.round += 1
        self.deadline = now + self.plan.barrier_seconds
        self.waiting = set(range(self.plan.replicas))
        not_before = time.time() + self.plan.delays[self.round - 1]
        self.announced = {"restart": self.round, "notBefore": not_before, "node": node, "code": code}
        return [self.announced]

    def ready(self, node: int, at_round: int) -> list[dict[str, Any]]:
        if self.aborted or at_round != self.round or self.deadline is None:
            return []
        self.waiting.discard(node)
        if self.waiting:
            return []
        self.deadline = None
        return [{"go": self.round}]

    def tick(self, now: float) -> list[dict[str, Any]]:
        if self.deadline is not None and now >= self.deadline and not self.aborted:
            return self._abort(f"replica(s) {sorted(self.waiting)} did not reach the barrier of in-place restart "
                               f"{self.round} within {self.plan.barrier_seconds:g}s (pod or node lost?)")
        return []

    def _abort(self, why: str) -> list[dict[str, Any]]:
        self.aborted = True
        self.deadline = None
        return [{"abort": self.round, "code": self.cause, "why": why}]


# ---- the coordination service (NODE_RANK 0's launcher) ----------------------------------------------------------


def bind_address(environ: Mapping[str, str]) -> str:
    """Where the coordinator listens: the pod's own IP (pods of a test node share one host), loopback for a local
    run, else every interface."""
    if environ.get("POD_IP"):
        return environ["POD_IP"]
    return "127.0.0.1" if environ.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost") else "0.0.0.0"


class Coordinator:
    """A threaded TCP server around one `Barrier`: a thread per launcher connection and one for the deadline."""

    def __init__(self, plan: InPlace, host: str) -> None:
        self.barrier = Barrier(plan)
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._sock = socket.create_server((host, plan.port), family=_family(host), reuse_port=False)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="restart-coordinator", daemon=True).start()
        threading.Thread(target=self._clock, name="restart-deadline", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            for c in self._conns.values():
                with contextlib.suppress(OSError):
                    c.close()

    def _send_all(self, messages: list[dict[str, Any]]) -> None:
        for msg in messages:  # under the lock: every launcher sees the messages in one order
            data = (json.dumps(msg) + "\n").encode()
            for c in list(self._conns.values()):
                with contextlib.suppress(OSError):
                    c.sendall(data)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _clock(self) -> None:
        while not self._closed.wait(0.1):
            with self._lock:
                self._send_all(self.barrier.tick(time.monotonic()))

    def _serve(self, conn: socket.socket) -> None:
        node: int | None = None
        try:
            for msg in _lines(conn):
                with self._lock:
                    if "hello" in msg:
                        node = int(msg["hello"])
                        self._conns[node] = conn
                        for late in self.barrier.join(node):
                            conn.sendall((json.dumps(late) + "\n").encode())
                        out = []
                    elif node is None:
                        return
                    elif "fail" in msg:
                        out = self.barrier.fail(node, int(msg["fail"]), int(msg.get("code", 1)), time.monotonic())
                    elif "ready" in msg:
                        out = self.barrier.ready(node, int(msg["ready"]))
                    else:
                        out = []
                    self._send_all(out)
        except (OSError, ValueError, TypeError):
            pass
        finally:
            with self._lock:
                if node is not None and self._conns.get(node) is conn:
                    del self._conns[node]
                    self._send_all(self.barrier.leave(node, time.monotonic()))
            with contextlib.suppress(OSError):
                conn.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _lines(conn: socket.socket):  # noqa: ANN202 - a generator of dicts
    buf = b""
    while True:
        chunk = conn.recv(4096)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            if isinstance(msg, dict):
                yield msg
        if len(buf) > _MAX_LINE:
            raise ValueError("line too long")


# ---- one launcher's connection --------------------------------------------------------------------------------


class Peer:
    """A launcher's connection to the coordinator: connects in the background (rank 0's pod may start later),
    queues what the coordinator says. `lost` is set once a connection that existed dropped."""

    def __init__(self, host: str, port: int, node: int, patience: float = DEFAULT_BARRIER_SECONDS) -> None:
        self.node = node
        self.patience = patience  # how long a failure report waits for a connection not made yet
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self.connected = threading.Event()
        self.lost = threading.Event()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(host, port), name="restart-peer", daemon=True).start()

    def send(self, msg: dict[str, Any]) -> bool:
        sock = self._sock
        if sock is None or self.lost.is_set():
            return False
        try:
            sock.sendall((json.dumps(msg) + "\n").encode())
            return True
        except OSError:
            self.lost.set()
            return False

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()

    def _run(self, host: str, port: int) -> None:
        while not self._stop.is_set():
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                self._stop.wait(CONNECT_RETRY_SECONDS)
        else:
            return
        sock.settimeout(None)
        self._sock = sock
        if not self.send({"hello": self.node}):
            return
        self.connected.set()
        try:
            for msg in _lines(sock):
                self.inbox.put(msg)
        except (OSError, ValueError):
            pass
        self.lost.set()


_stepped = False


def die_with_launcher(environ: Mapping[str, str] | None = None) -> None:
    """In a rank the launcher started (it sets SEQTRAIN_RESTART_ROUND): die by SIGKILL when the launcher dies. A
    lost pod takes its launcher down with every process of its group, but the ranks run in sessions of their own;
    on a real node the container's cgroup goes too, elsewhere (the test node agent, a SIGKILLed local replica) an
    orphaned rank would train on and keep its peers from noticing the loss."""
    env = os.environ if environ is None else environ
    if ROUND_ENV not in env or not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    launcher = env.get(LAUNCHER_PID_ENV, "")
    if launcher.isdigit() and os.getppid() != int(launcher):  # it died before the line above took effect
        os._exit(128 + signal.SIGKILL)


def mark_stepped() -> None:
    """In a rank, after each step (cheap: acts once): create SEQTRAIN_STEPPED_FILE, so the launcher knows this
    incarnation got past start-up. A failure before the first step is not restarted in place: a start-up failure
    is the controller's to judge (it stops one that repeats identically), and re-creating may move the pod."""
    global _stepped
    if _stepped:
        return
    _stepped = True
    path = os.environ.get(STEPPED_ENV, "")
    if path:
        with contextlib.suppress(OSError):
            open(path, "a").close()  # noqa: SIM115


def await_start() -> None:
    """In a spare rank (SEQTRAIN_STANDBY_FD set): the launcher started it ahead of the next in-place restart, so
    that its imports (torch: seconds) are done when the restart comes. Block until the launcher writes the start
    order, one JSON line of environment variables (the round, its backoff); end quietly when it closes the pipe
    instead (no restart came)."""
    raw = os.environ.pop(STANDBY_ENV, "")
    if not raw.isdigit():
        return
    # the line users (and the recovery benchmarks) read to know an in-place restart will not wait for imports
    print(f"seqtrain: spare rank {os.environ.get('RANK', '?')} ready for in-place restart "
          f"{os.environ.get(ROUND_ENV, '?')}", file=sys.stderr, flush=True)
    with os.fdopen(int(raw), "r", encoding="utf-8") as pipe:
        line = pipe.readline()
    if not line.strip():
        os._exit(0)
    order = json.loads(line)
    os.environ.update({str(k): str(v) for k, v in order.items()})


def wait_not_before(environ: Mapping[str, str] | None = None, stop: Callable[[], bool] = lambda: False) -> None:
    """In a rank, set up and about to train: wait until SEQTRAIN_START_NOT_BEFORE (the in-place restart's backoff),
    so the backoff overlaps the start-up instead of adding to it. `stop` (a SIGTERM came) ends the wait early: the
    grace period may be shorter than the backoff."""
    raw = (os.environ if environ is None else environ).get(NOT_BEFORE_ENV, "")
    with contextlib.suppress(ValueError):
        until = min(float(raw), time.time() + 3600.0) if raw else 0.0
        while not stop() and (left := until - time.time()) > 0:
            time.sleep(min(left, 0.1))
