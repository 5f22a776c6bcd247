"""A gang of local replica processes: started together with a pod's bootstrap environment, observed, stopped together.

Each replica runs exactly what its pod would (`seqtrain.runtime.launch.replica_command`): `seqtrain train --config F`
for one rank, `seqtrain train --config F --nproc-per-node N` (the one launcher) for several, and its exit code is the
replica's exit code by the launcher's one rule. Every process runs in its own session (process group) so that
stopping it also stops anything it spawned (data workers, compilers), and so that Ctrl-C in the terminal reaches only
the runner, which then stops the gang in order. Rank r logs to `<log_dir>/rank-r.log`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from seqtrain.runtime.exitcodes import last_error
from seqtrain.runtime.launch import cpu_budget, free_port, normalize, replica_command
from seqtrain.runtime.restart import rounds_in
from seqtrain.spec.replica_env import GRACE_ENV, IDENTITY, RANK_EXIT, cpu_share, first_rank_exit, replica_env
from seqtrain_operator.controller.clock import iso, utcnow
from seqtrain_operator.controller.failure_policy import describe_exit
from seqtrain_operator.controller.types import ReplicaObservation

NODE = "localhost"
TERM_GRACE_SECONDS = 30.0  # SIGTERM -> SIGKILL: the trainer finishes its step and saves within this
_CLI = (sys.executable, "-m", "seqtrain_operator.cli")
CAUSE_MAX = 300  # characters of a rank failure's description in an event line


def source_roots() -> list[str]:
    """The `trainer/` and `operator/` roots this code runs from, so ranks import the same code without install."""
    import seqtrain

    op_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tr_root = os.path.dirname(os.path.dirname(os.path.abspath(seqtrain.__file__)))
    return [tr_root, op_root]


def process_env(environ: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every local replica inherits before the contract's variables: this process's environment (and
    `extra`), the source roots on PYTHONPATH so ranks import this code without an install, and no identity
    variables (a replica's come from the contract only)."""
    base = {**environ, **(extra or {})}
    roots = source_roots()
    base["PYTHONPATH"] = os.pathsep.join(roots + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else []))
    for name in IDENTITY:
        base.pop(name, None)
    return base


def local_replica_env(*, replica: int, attempt: int, replicas: int, procs: int, gpus_per_replica: int,
                      master_port: int, log_dir: str | None = None, in_place_delays: tuple[float, ...] = (),
                      restart_port: int | None = None, given: Mapping[str, str] | None = None,
                      job: str | None = None) -> dict[str, str]:
    """The pod contract (seqtrain.spec.replica_env) with a local machine's arguments: loopback, the gang's free
    port, this backend's stop deadline (TERM_GRACE_SECONDS); every rank of the job shares this machine's CPUs and
    each replica sees only its own GPUs. What the user (or a test) set in `given` for OMP_NUM_THREADS and the
    grace period wins: a test may give the trainer less time."""
    given = given or {}
    env = replica_env(replica=replica, attempt=attempt, world_size=replicas * procs, procs=procs,
                      master_addr="127.0.0.1", master_port=master_port, grace_period=TERM_GRACE_SECONDS, job=job,
                      omp_threads=None if given.get("OMP_NUM_THREADS") else cpu_share(cpu_budget(), replicas * procs),
                      visible_gpus=(range(replica * gpus_per_replica, (replica + 1) * gpus_per_replica)
                                    if gpus_per_replica > 0 else None),
                      rank_log_dir=log_dir, in_place_delays=in_place_delays, restart_port=restart_port)
    if given.get(GRACE_ENV):
        env[GRACE_ENV] = given[GRACE_ENV]
    return env


def exit_code(returncode: int) -> int:
    """Shell convention: a process killed by signal N exits 128+N (what a pod's container status reports)."""
    return normalize(returncode)


@dataclass
class Replica:
    replica: int
    proc: subprocess.Popen
    ranks: list[int]
    log_dir: str
    log_path: str  # the replica process's own output (the rank's log when it is one rank)
    supervised: bool = False  # its ranks run under the launcher (several ranks, or in-place restarts)
    # When we first saw it exit (a pod's finishedAt): the core waits for the rest of the gang (up to its settle time)
    # before charging a failure, so an echo (a peer died, the collective broke) seen first is not reported as the cause.
    finished_at: str | None = None

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid: the process itself for one rank; else what the launcher recorded once it started them."""
        if not self.supervised:
            return {self.ranks[0]: self.proc.pid}
        try:
            with open(os.path.join(self.log_dir, f"replica-{self.replica}.pids"), encoding="utf-8") as f:
                return {int(k): int(v) for k, v in json.load(f).items()}
        except (OSError, ValueError):
            return {}


@dataclass
class LocalGang:
    """One incarnation (attempt) of the gang."""

    attempt: int
    replicas: int
    procs_per_replica: int
    members: list[Replica] = field(default_factory=list)
    port: int = 0
    # how far the launchers' and ranks' logs were read for `rank_failures` (path -> offset)
    _read_to: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, attempt: int, replicas: int, procs_per_replica: int, gpus_per_replica: int, config_path: str,
              log_dir: str, extra_env: Mapping[str, str] | None = None,
              command: Sequence[str] | None = None, in_place_delays: tuple[float, ...] = (),
              job: str | None = None) -> LocalGang:
        """Spawn every replica (all or none) with the pod contract's environment (`local_replica_env`). `command`
        replaces the rank's `seqtrain train --config` (tests use tiny fakes); a multi-rank replica still runs it
        through the one launcher, and so does every replica when `in_place_delays` (CreateGang.in_place_delays)
        allows in-place restarts: its launcher survives its ranks. `job`: the job's name, given to the ranks as a
        pod's are given theirs."""
        gang = cls(attempt=attempt, replicas=replicas, procs_per_replica=procs_per_replica, port=free_port())
        os.makedirs(log_dir, exist_ok=True)
        base = process_env(os.environ, extra_env)
        supervised = procs_per_replica > 1 or bool(in_place_delays)
        restart_port = free_port() if in_place_delays else None
        try:
            for replica in range(replicas):
                env = {**base, **local_replica_env(
                    replica=replica, attempt=attempt, replicas=replicas, procs=procs_per_replica,
                    gpus_per_replica=gpus_per_replica, master_port=gang.port, log_dir=log_dir if supervised else None,
                    in_place_delays=in_place_delays, restart_port=restart_port, given=base, job=job)}
                ranks = list(range(replica * procs_per_replica, (replica + 1) * procs_per_replica))
                if not supervised:
                    argv = list(command) if command else replica_command(config_path, 1, _CLI)
                    log_path = os.path.join(log_dir, f"rank-{ranks[0]}.log")
                else:  # the launcher writes rank-r.log and the ranks' pids into log_dir
                    argv = ([sys.executable, "-m", "seqtrain.runtime.launch", f"--nproc-per-node={procs_per_replica}",
                             "--", *command] if command else
                            replica_command(config_path, procs_per_replica, _CLI))  # one rank: SEQTRAIN_INPLACE_DELAYS
                    log_path = os.path.join(log_dir, f"replica-{replica}.log")
                with open(log_path, "ab") as log:
                    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
                gang.members.append(Replica(replica, proc, ranks, log_dir, log_path, supervised))
        except BaseException:
            gang.stop(grace=0)  # all or none
            raise
        return gang

    def pids(self) -> dict[int, int]:
        """rank -> pid of every rank known so far."""
        out: dict[int, int] = {}
        for m in self.members:
            out.update(m.rank_pids())
        return out

    def observe(self) -> tuple[ReplicaObservation, ...]:
        out = []
        for m in self.members:
            rc = m.proc.poll()
            if rc is None:
                out.append(ReplicaObservation(m.replica, self.attempt, "Running", node=NODE))
            elif rc == 0:
                out.append(ReplicaObservation(m.replica, self.attempt, "Succeeded", exit_code=0, node=NODE))
            else:
                # The replica's code is already the one rule's answer (seqtrain.runtime.launch.replica_exit_code).
                m.finished_at = m.finished_at or iso(utcnow())
                code = exit_code(rc)
                rank, error, log = self._cause(m)
                rounds = rounds_in(_tail(m.log_path)) if m.supervised else 0
                # the failure's message names the replica, its rank and exit code (controller.failure_policy)
                said = error or _describe(rc)
                out.append(ReplicaObservation(m.replica, self.attempt, "Failed", exit_code=code, node=NODE,
                                              message=f"{said}; log {log}", error=error, restart_round=rounds,
                                              finished_at=m.finished_at, rank=rank))
        return tuple(out)

    @staticmethod
    def _cause(m: Replica) -> tuple[int, str | None, str]:
        """(the rank whose exit ended the replica, its error line, its log): of several ranks the first the
        launcher reported (its peers' lines are echoes of it); when the launcher named none, the first rank that
        logged an error line."""
        first = first_rank_exit(_tail(m.log_path)) if m.supervised else None
        if first is not None or len(m.ranks) == 1:
            rank = m.ranks[0] + (first[0] if first is not None else 0)
            log = os.path.join(m.log_dir, f"rank-{rank}.log")
            return rank, last_error(_tail(log)), log
        logs = {r: os.path.join(m.log_dir, f"rank-{r}.log") for r in m.ranks}
        said = [(r, e) for r in m.ranks if (e := last_error(_tail(logs[r])))]
        rank, error = said[0] if said else (m.ranks[0], None)
        return rank, error, logs[rank]

    def rank_failures(self) -> list[str]:
        """The rank failures the replicas' launchers reported since the last call, each as 'rank R exit code C
        (killed by SIG...): <the rank's error line>': what a restart in place (the launcher restarted its ranks, the
        replica process never ended) does not show otherwise. The error line is the last one the rank logged since
        the previous call, so an earlier round's error is not repeated."""
        out = []
        for m in self.members:
            if not m.supervised:
                continue
            for local, code in RANK_EXIT.findall(self._read_new(m.log_path)):
                rank = m.ranks[0] + int(local)
                error = last_error(self._read_new(os.path.join(m.log_dir, f"rank-{rank}.log")))
                text = f"rank {rank} {describe_exit(int(code))}" + (f": {error}" if error else "")
                out.append(text if len(text) <= CAUSE_MAX else text[:CAUSE_MAX - 3] + "...")
        return out

    def _read_new(self, path: str) -> str:
        start = self._read_to.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return ""
        self._read_to[path] = start + len(data)
        return data.decode("utf-8", "replace")

    def alive(self) -> bool:
        return any(m.proc.poll() is None for m in self.members) or any(_alive(p) for p in self.pids().values())

    def stop(self, grace: float = TERM_GRACE_SECONDS) -> None:
        """SIGTERM every replica's process group (a launcher forwards it to its ranks), wait up to `grace` seconds,
        then SIGKILL what is left (ranks included, even if their launcher is gone) and reap all."""
        for m in self.members:
            _signal_group(m.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.05)
        for pid in [*self.pids().values(), *(m.proc.pid for m in self.members)]:
            # The groups too: a process that exited may have left children behind.
            _signal_group(pid, signal.SIGKILL)
        for m in self.members:
            # A process even SIGKILL cannot stop (uninterruptible I/O) is left to the OS rather than hang us.
            with contextlib.suppress(subprocess.TimeoutExpired):
                m.proc.wait(timeout=10)

    def to_json(self) -> str:
        ranks = self.pids()
        return json.dumps({"attempt": self.attempt, "masterPort": self.port,
                           "replicas": [{"replica": m.replica, "pid": m.proc.pid, "log": m.log_path}
                                        for m in self.members],
                           "ranks": [{"rank": r, "pid": pid} for r, pid in sorted(ranks.items())]}, indent=2) + "\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie (exited, not yet reaped by its launcher) is not running
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


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


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # start_new_session: pgid == pid


def kill_leftovers(gang_file: str) -> int:
    """Kill the process groups a previous runner recorded in gang.json (replicas, and the ranks their launchers
    recorded) if they still run our trainer (the runner itself was killed hard). Returns how many were signalled."""
    try:
        with open(gang_file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return 0
    pids = [int(r.get("pid", 0)) for r in data.get("ranks", [])]
    for rep in data.get("replicas", []):
        pids.append(int(rep.get("pid", 0)))
        recorded = os.path.join(os.path.dirname(str(rep.get("log", ""))), f"replica-{rep.get('replica')}.pids")
        with contextlib.suppress(OSError, ValueError, TypeError), open(recorded, encoding="utf-8") as f:
            pids += [int(p) for p in json.load(f).values()]
    n = 0
    for pid in sorted(set(pids)):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"seqtrain" in cmd and any(k in cmd for k in (b" train ", b"seqtrain.train.entry", b"seqtrain.runtime.launch")):
            try:
                os.killpg(pid, signal.SIGKILL)
                n += 1
            except (ProcessLookupError, PermissionError):
                pass
    return n
