"""A gang of local rank processes: started together with a pod's bootstrap environment, observed, stopped together.

Each rank runs in its own session (process group) so that stopping it also stops anything it spawned (data
workers, compilers), and so that Ctrl-C in the terminal reaches only the runner, which then stops the gang in order.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from seqtrain.train.exitcodes import last_error

from ..controller.types import ReplicaObservation

NODE = "localhost"
TERM_GRACE_SECONDS = 30.0  # SIGTERM -> SIGKILL: the trainer finishes its step and saves within this


def free_port() -> int:
    """A TCP port free right now on the loopback interface (a fresh one per attempt: the old rendezvous may linger
    in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def source_roots() -> list[str]:
    """The `trainer/` and `operator/` roots this code runs from, so ranks import the same code without install."""
    import seqtrain

    op_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tr_root = os.path.dirname(os.path.dirname(os.path.abspath(seqtrain.__file__)))
    return [tr_root, op_root]


def rank_command(config_path: str) -> list[str]:
    return [sys.executable, "-m", "seqtrain_operator.cli", "train", "--config", config_path]


def exit_code(returncode: int) -> int:
    """Shell convention: a rank killed by signal N exits 128+N (what a pod's container status reports)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Rank:
    rank: int
    replica: int
    proc: subprocess.Popen
    log_path: str


@dataclass
class LocalGang:
    """One incarnation (attempt) of the gang."""

    attempt: int
    replicas: int
    procs_per_replica: int
    ranks: list[Rank] = field(default_factory=list)
    port: int = 0

    @classmethod
    def start(cls, attempt: int, replicas: int, procs_per_replica: int, gpus_per_replica: int, config_path: str,
              log_dir: str, extra_env: Mapping[str, str] | None = None,
              command: Sequence[str] | None = None) -> LocalGang:
        """Spawn every rank (all or none). `command` replaces `seqtrain train --config` (tests use tiny fakes)."""
        gang = cls(attempt=attempt, replicas=replicas, procs_per_replica=procs_per_replica, port=free_port())
        world = replicas * procs_per_replica
        os.makedirs(log_dir, exist_ok=True)
        base = dict(os.environ)
        base.update(extra_env or {})
        roots = source_roots()
        base["PYTHONPATH"] = os.pathsep.join(roots + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else []))
        # Threads per rank: share the cores instead of every rank grabbing all of them.
        base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        base["PYTHONUNBUFFERED"] = "1"
        try:
            for rank in range(world):
                replica, local = divmod(rank, procs_per_replica)
                env = dict(base)
                env.update({
                    "RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(procs_per_replica),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(gang.port),
                    "SEQTRAIN_REPLICA": str(replica), "SEQTRAIN_ATTEMPT": str(attempt),
                })
                if gpus_per_replica > 0:
                    # Like a pod: each replica sees only its own GPUs, numbered from 0.
                    first = replica * gpus_per_replica
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(first, first + gpus_per_replica))
                log_path = os.path.join(log_dir, f"rank-{rank}.log")
                with open(log_path, "ab") as log:
                    proc = subprocess.Popen(list(command or rank_command(config_path)), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
                gang.ranks.append(Rank(rank, replica, proc, log_path))
        except BaseException:
            gang.stop(grace=0)  # all or none
            raise
        return gang

    def pids(self) -> dict[int, int]:
        return {r.rank: r.proc.pid for r in self.ranks}

    def observe(self) -> tuple[ReplicaObservation, ...]:
        out = []
        for replica in range(self.replicas):
            ranks = [r for r in self.ranks if r.replica == replica]
            codes = [(r, r.proc.poll()) for r in ranks]
            failed = [(r, c) for r, c in codes if c is not None and c != 0]
            if failed:
                # The first rank to have failed is unknown after the fact; report the most telling code: a signal
                # (killed from outside or OOM) over a plain error, which is often only the echo of a dead peer.
                r, c = max(failed, key=lambda rc: (rc[1] < 0, -rc[0].rank))
                code = exit_code(c)
                error = last_error(_tail(r.log_path))
                said = f" ({error})" if error else ""
                out.append(ReplicaObservation(replica, self.attempt, "Failed", exit_code=code, node=NODE,
                                              message=f"rank {r.rank} {_describe(c)}{said}; log {r.log_path}",
                                              error=error))
            elif all(c == 0 for _, c in codes):
                out.append(ReplicaObservation(replica, self.attempt, "Succeeded", exit_code=0, node=NODE))
            else:
                out.append(ReplicaObservation(replica, self.attempt, "Running", node=NODE))
        return tuple(out)

    def alive(self) -> bool:
        return any(r.proc.poll() is None for r in self.ranks)

    def stop(self, grace: float = TERM_GRACE_SECONDS) -> None:
        """SIGTERM every rank's process group, wait up to `grace` seconds, then SIGKILL what is left and reap all."""
        for r in self.ranks:
            _signal_group(r.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.05)
        for r in self.ranks:
            # The group too: a rank that exited may have left children behind.
            _signal_group(r.proc, signal.SIGKILL)
        for r in self.ranks:
            # A process even SIGKILL cannot stop (uninterruptible I/O) is left to the OS rather than hang us.
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=10)

    def to_json(self) -> str:
        return json.dumps({"attempt": self.attempt, "masterPort": self.port,
                           "ranks": [{"rank": r.rank, "replica": r.replica, "pid": r.proc.pid, "log": r.log_path}
                                     for r in self.ranks]}, indent=2) + "\n"


def _tail(path: str, size: int = 8192) -> str:
    """The end of a rank's log (where its error line is), like a pod's termination message on error."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # start_new_session: pgid == pid


def kill_leftovers(gang_file: str) -> int:
    """Kill the process groups a previous runner recorded in gang.json if they still run our trainer (the runner
    itself was killed hard). Returns how many groups were signalled."""
    try:
        with open(gang_file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return 0
    n = 0
    for r in data.get("ranks", []):
        pid = int(r.get("pid", 0))
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"seqtrain" in cmd and b" train " in cmd:
            try:
                os.killpg(pid, signal.SIGKILL)
                n += 1
            except (ProcessLookupError, PermissionError):
                pass
    return n
