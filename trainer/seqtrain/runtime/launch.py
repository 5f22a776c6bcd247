"""The one launcher: `seqtrain train --config F --nproc-per-node N` starts one replica's N rank processes (in a pod,
and per replica in the local backend, which runs exactly the pod's command) and maps their exit codes to the
replica's exit code by the one rule, `replica_exit_code`; the controller reads only that code. `free_port` and
`replica_command` live here too, for every caller that starts ranks (local backend, manifests, tests, benchmarks).

Why not torchrun: it exits 1 whenever a child fails, so the trainer's exit codes (exitcodes.py: 3 invalid config =
permanent, 4 collective timeout, 143 SIGTERM after a checkpoint) never reach the pod's container status, and the
operator would restart a gang whose config can never work. This launcher is pure Python (no torch), so it adds
nothing to the image and never loads torch itself.

What it does, in order:
- reads the pod's bootstrap environment (WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT; `rank_envs`) and gives
  child `local` RANK = NODE_RANK * N + local, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
  CUDA_VISIBLE_DEVICES is left alone (each rank takes cuda:LOCAL_RANK); OMP_NUM_THREADS, unless set, is the
  container's CPUs (`cpu_budget`) divided by N; PYTORCH_CUDA_ALLOC_CONF, unless set, is
  `expandable_segments:True` (`cuda_alloc_env`); glibc's malloc settings, each unless set, so that memory a rank
  frees goes back to the OS and its resident set is what it holds (`malloc_env`);
- starts every child in its own session (process group), so a signal reaches the child and anything it spawned;
- forwards SIGTERM/SIGINT to every child and waits up to SEQTRAIN_TERM_GRACE_SECONDS (the manifests set it a little
  below the pod's terminationGracePeriodSeconds) before SIGKILL;
- when a child exits non-zero, SIGTERMs the others and SIGKILLs them after FAILURE_GRACE_SECONDS;
- exits with `replica_exit_code` of the children's codes; unless the gang may restart in place
  (SEQTRAIN_INPLACE_DELAYS, seqtrain.runtime.restart): then the launchers of every replica stop their ranks, meet
  at a barrier and start them again from the latest checkpoint, and exit only when that is not possible;
- gives every rank SEQTRAIN_RESTART_ROUND (0 on the first start) and makes it die with the launcher.
Locally (never in a pod) SEQTRAIN_RANK_LOG_DIR=DIR sends rank r's output to DIR/rank-r.log and records the ranks'
pids in DIR/replica-<NODE_RANK>.pids (JSON {rank: pid}), so the local backend keeps per-rank logs and can stop
every rank even if this launcher itself is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType

from seqtrain.runtime import exitcodes, restart

GRACE_ENV = "SEQTRAIN_TERM_GRACE_SECONDS"
LOG_DIR_ENV = "SEQTRAIN_RANK_LOG_DIR"
DEFAULT_TERM_GRACE_SECONDS = 30.0  # SIGTERM -> SIGKILL when the pod is stopped (the trainer checkpoints within it)
# SIGTERM -> SIGKILL for the surviving ranks after one failed: their gang is broken, so they cannot finish a step or
# a collective checkpoint; a rank blocked in NCCL only leaves by SIGKILL.
FAILURE_GRACE_SECONDS = 10.0
POLL_SECONDS = 0.05
_FORWARDED = (signal.SIGTERM, signal.SIGINT)
_STARTED_AT = time.time()  # this launcher process is the incarnation: its rounds' ranks count time from here


class LaunchError(Exception):
    """The pod's bootstrap environment cannot give N ranks an identity; the message names the variable. Exits 3."""


# ---- pure parts ------------------------------------------------------------------------------------------------


def normalize(returncode: int) -> int:
    """Popen's returncode -> a shell-style exit code: killed by signal N is 128 + N (what a container status says)."""
    return 128 - returncode if returncode < 0 else returncode


def replica_exit_code(codes: Sequence[int]) -> int:
    """THE rule from rank exits to a replica's exit code (the pod's, or the local replica process's); codes are
    normalized and listed in the order the ranks ended.

    3 (invalid config, permanent) if any rank exited 3: it decides that restarting cannot help, wherever it came.
    Else the first failing rank's code: the cause. The later ones are mostly ranks stopped because of it (143, 137),
    and a collective timeout (4) is itself the echo of a peer that died or hung, so it is reported only when it
    came first (then the peer is in another replica, whose own code the controller prefers, see failure_policy).
    0 only when every rank exited 0."""
    if exitcodes.INVALID_CONFIG in codes:
        return exitcodes.INVALID_CONFIG
    if exitcodes.DEVICE_UNAVAILABLE in codes:  # a node fault on any rank: restarting elsewhere can help
        return exitcodes.DEVICE_UNAVAILABLE
    if exitcodes.CHECKPOINT_UNAVAILABLE in codes:  # the others' failures are its echo (a broken collective)
        return exitcodes.CHECKPOINT_UNAVAILABLE
    if exitcodes.STORAGE_FULL in codes:  # the same: the full volume is the cause, the others echo it
        return exitcodes.STORAGE_FULL
    return next((c for c in codes if c != 0), exitcodes.OK)


def replica_command(config: str, nproc: int, program: Sequence[str] = ("seqtrain",)) -> list[str]:
    """What a replica runs (a pod's container command; the local backend runs the same with `program` = this
    Python's `-m seqtrain_operator.cli`): one rank directly, several through this launcher."""
    cmd = [*program, "train", "--config", config]
    return cmd if nproc == 1 else [*cmd, f"--nproc-per-node={nproc}"]


def _int_env(environ: Mapping[str, str], name: str, default: int | None, why: str) -> int:
    raw = environ.get(name, "")
    if raw == "":
        if default is None:
            raise LaunchError(f"environment variable {name} is required {why}")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name}={raw!r} must be an integer") from None


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on (or holds, as a connection's local end) host:port; TIME_WAIT does not count, as for the
    servers that take the port (the TCPStore's libuv listener, socket.create_server and Go's net.Listen all set
    SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(span: int = 1, band: tuple[int, int] = (12000, 2000)) -> int:
    """A TCP port P free right now on loopback (and P+1 .. P+span-1 with it), the only copy: every rank-starting
    path uses it. It is picked at random below the kernel's ephemeral range, not by bind(("", 0)): a port from that
    range is free only until the caller's server binds it, and meanwhile any process's bind(0) or outgoing
    connection may take it (rank 0 then fails with EADDRINUSE). Below the range only an explicit bind can take
    it. `band` = (a, b): from low-a up to low-b, where low is the range's start; the top 2000 are left to ports a
    caller reserves for a long time without holding them (the testbed's rendezvous port, used by job after job),
    which a short-lived pick must not hit. Falls back to bind(0) on a machine whose range leaves no room below
    it."""
    low = 32768
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/net/ipv4/ip_local_port_range",
                                                        encoding="ascii") as f:
        low = int(f.read().split()[0])
    rng = random.Random()  # its own generator: a test that seeds the global one must not make every pick equal
    first, last = max(1024, low - band[0]), low - band[1] - span  # last: P+span-1 stays below low-b
    if last - first > 100:
        for _ in range(200):
            port = rng.randrange(first, last + 1)
            if all(bindable(p) for p in range(port, port + span)):
                return port
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if all(bindable(p) for p in range(port, port + span)):
            return port
    raise LaunchError(f"no {span} free consecutive TCP port(s) on 127.0.0.1")


CUDA_ALLOC_VAR = "PYTORCH_CUDA_ALLOC_CONF"
CUDA_ALLOC_DEFAULT = "expandable_segments:True"


def cuda_alloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The CUDA caching allocator's setting for a rank: expandable segments (one growing mapping per stream instead of
    fixed-size blocks) unless the user set PYTORCH_CUDA_ALLOC_CONF. Variable sequence lengths and packed batches
    otherwise fragment the cache into blocks no later request fits, which shows as an out-of-memory error with
    gigabytes reserved but free. Only CUDA's allocator reads it (a CPU rank ignores it), and it must be in the
    environment before the rank's first CUDA allocation: the launcher gives it to every child, and a CUDA rank
    started without the launcher sets it itself (`seqtrain.runtime.dist.init_distributed`)."""
    return {} if environ.get(CUDA_ALLOC_VAR) else {CUDA_ALLOC_VAR: CUDA_ALLOC_DEFAULT}


# glibc malloc, for a process whose big buffers come and go every step (tensors: torch's CPU allocator has no cache
# and hands every free to malloc). glibc's default mmap threshold grows to 32 MiB after the first large free, so
# freed 1-32 MiB tensors stay in the heap, resident, and a heap shrinks only from its top: after an FSDP2 backward
# the 350m job's busiest rank kept ~800 MiB of freed gather and gradient buffers (tests/integration/
# test_sharded_init.py). A fixed 1 MiB threshold maps every buffer of 1 MiB or more on its own (munmap on free);
# the trim threshold returns freed heap tops beyond 1 MiB; two arenas stop every gloo/OpenMP thread from growing a
# heap of its own (each one's freed chunks stay resident). What is left resident is what the rank holds, which is
# what resources.memory is checked and enforced against (seqtrain.spec.memory).
MALLOC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20),
                   "MALLOC_ARENA_MAX": "2"}
# mallopt(3) parameters of the same settings, for a rank started without this launcher (one rank per pod)
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_ARENA_MAX": -8}


def malloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The glibc malloc variables a rank gets: MALLOC_DEFAULTS, each one the user has not set (then theirs wins)."""
    return {k: v for k, v in MALLOC_DEFAULTS.items() if not environ.get(k)}


def apply_malloc_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """In a rank started without the launcher (glibc read its environment at exec, before we could set it): apply
    `malloc_env` with mallopt(3), before the rank allocates its model. Returns what was applied (nothing off glibc,
    or when every variable is set: glibc took the user's values at start)."""
    return set_malloc(malloc_env(os.environ if environ is None else environ))


def set_malloc(values: Mapping[str, str]) -> dict[str, str]:
    """Set glibc malloc variables (`MALLOC_DEFAULTS`' names) in this process with mallopt(3), as glibc would have
    read them at exec; returns what took (nothing off glibc)."""
    import ctypes
    import ctypes.util

    todo = {k: v for k, v in values.items() if k in _MALLOPT}
    name = ctypes.util.find_library("c")
    if not todo or name is None:
        return {}
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return {}
    return {k: v for k, v in todo.items() if mallopt(_MALLOPT[k], int(v)) == 1}


def rank_envs(nproc: int, environ: Mapping[str, str]) -> list[dict[str, str]]:
    """The variables each of the `nproc` children gets on top of `environ` (index = local rank).

    WORLD_SIZE unset means this pod is the whole job (then NODE_RANK defaults to 0 and the rendezvous to a free
    loopback port). NODE_RANK falls back to SEQTRAIN_REPLICA, the replica index the manifests also set."""
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node={nproc} must be at least 1")
    world = _int_env(environ, "WORLD_SIZE", nproc, "")
    local_world = _int_env(environ, "LOCAL_WORLD_SIZE", nproc, "")
    if local_world != nproc:
        raise LaunchError(f"LOCAL_WORLD_SIZE={local_world} disagrees with --nproc-per-node={nproc}; "
                          "set both to resources.processesPerReplica")
    if world % nproc:
        raise LaunchError(f"WORLD_SIZE={world} is not a multiple of --nproc-per-node={nproc}")
    node_var = "SEQTRAIN_REPLICA" if not environ.get("NODE_RANK") and environ.get("SEQTRAIN_REPLICA") else "NODE_RANK"
    node_rank = _int_env(environ, node_var, None if world > nproc else 0,
                         "(or SEQTRAIN_REPLICA) when WORLD_SIZE is larger than --nproc-per-node")
    if not 0 <= node_rank < world // nproc:
        raise LaunchError(f"{node_var}={node_rank} must be in [0, WORLD_SIZE / --nproc-per-node = {world // nproc})")
    if world > nproc:
        addr = environ.get("MASTER_ADDR", "")
        port = str(_int_env(environ, "MASTER_PORT", None, "when WORLD_SIZE > --nproc-per-node"))
        if not addr:
            raise LaunchError("environment variable MASTER_ADDR is required when WORLD_SIZE > --nproc-per-node "
                              "(the address of node rank 0)")
    else:  # the whole job is in this pod: rendezvous on loopback unless told otherwise
        addr = environ.get("MASTER_ADDR") or "127.0.0.1"
        port = environ.get("MASTER_PORT") or str(free_port())
    threads = environ.get("OMP_NUM_THREADS") or str(max(1, cpu_budget() // nproc))
    return [{"RANK": str(node_rank * nproc + local), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(nproc), "NODE_RANK": str(node_rank), "MASTER_ADDR": addr, "MASTER_PORT": port,
             "OMP_NUM_THREADS": threads, **cuda_alloc_env(environ), **malloc_env(environ)} for local in range(nproc)]


def cpu_budget(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPUs this container may use: the affinity mask, capped by the cgroup v2 CPU limit (a pod's limits.cpu), so
    the ranks share the pod's CPUs instead of each starting a thread per core of the node."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with contextlib.suppress(OSError, ValueError):
        with open(cpu_max, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    return cpus


# ---- processes -------------------------------------------------------------------------------------------------


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # start_new_session: the child's pgid is its pid


def _say(text: str) -> None:
    print(f"seqtrain launch: {text}", file=sys.stderr, flush=True)


def launch(command: Sequence[str], nproc: int, environ: Mapping[str, str] | None = None,
           term_grace: float = DEFAULT_TERM_GRACE_SECONDS, failure_grace: float = FAILURE_GRACE_SECONDS,
           standby: bool = False) -> int:
    """Run `command` as `nproc` rank processes; return the pod's exit code (`replica_exit_code`).

    With SEQTRAIN_INPLACE_DELAYS set (seqtrain.runtime.restart), a restartable rank failure restarts the ranks of
    every replica in place, as the coordinator's rounds say, until the in-place restarts are used up. `standby`
    (the command is the trainer, which honours SEQTRAIN_STANDBY_FD): each round also starts spare ranks for the
    next one, which import torch while it trains, so an in-place restart does not wait for the imports.
    Installs SIGTERM/SIGINT handlers for the duration (main thread only) and restores the previous ones."""
    base = dict(os.environ if environ is None else environ)
    try:
        envs = rank_envs(nproc, base)
        plan = restart.in_place_from(base, int(envs[0]["WORLD_SIZE"]) // nproc)
    except (LaunchError, restart.RestartConfigError) as exc:
        _say(f"invalid config: {exc}")
        return exitcodes.INVALID_CONFIG
    procs: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for p in procs:
            if p.returncode is None:  # not reaped yet (no waitpid in a handler: it may interrupt poll())
                _signal_group(p, signum)

    node = int(envs[0]["NODE_RANK"])
    coordinator = peer = None
    if plan.enabled:
        host = restart.bind_address(base)
        if node == 0:
            try:
                coordinator = restart.Coordinator(plan, host)
            except OSError as exc:  # the port is taken: no in-place restart, today's behaviour
                _say(f"cannot serve in-place restarts on {host}:{plan.port} ({exc}); a failure re-creates the gang")
        target = (host if host != "0.0.0.0" else "127.0.0.1") if node == 0 else envs[0]["MASTER_ADDR"]
        peer = restart.Peer(target, plan.port, node, plan.barrier_seconds)
    log_dir = base.get(LOG_DIR_ENV) or None
    marks = tempfile.mkdtemp(prefix="seqtrain-launch-") if plan.enabled else None
    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    rnd = _Round(0)
    spares: list[tuple[subprocess.Popen, int]] = []
    try:
        while True:
            codes: list[int] = []
            procs.clear()
            order = _round_env(rnd, marks)
            if spares and len(spares) == len(envs) and all(p.poll() is None for p, _ in spares) and not received:
                procs.extend(_release(spares, order))  # imports done: they go on from here
            else:
                _drop(spares)
                for local, extra in enumerate(envs):
                    if received:  # stopped while starting: start no more ranks
                        break
                    try:
                        procs.append(_start_rank(command, {**base, **extra, **order}, log_dir, extra["RANK"])[0])
                    except OSError as exc:
                        _say(f"cannot start local rank {local}: {exc}")
                        codes.append(exitcodes.ERROR)  # counts as the first failure: _wait stops the ranks started
                        break
            spares = []
            after_first_step = None
            if standby and plan.enabled and rnd.number < len(plan.delays) and not received and not codes:
                # Spares for the next in-place restart, started once this round has completed a step: they import
                # torch while it trains, not while its ranks start (on a pod's few cores they would slow the start
                # they are there to speed up, and a round that never steps is not restarted in place).
                def after_first_step(following: _Round = _Round(rnd.number + 1), out: list = spares) -> None:
                    with contextlib.suppress(OSError):
                        for extra in envs:
                            out.append(_start_rank(command, {**base, **extra, **_round_env(following, marks)},
                                                   log_dir, extra["RANK"], standby=True))
            if log_dir:
                _write_pids(log_dir, envs[0]["NODE_RANK"], {e["RANK"]: p.pid for e, p in zip(envs, procs, strict=False)})
            codes = _wait(procs, codes, term_grace, failure_grace, received, peer, rnd, after_first_step)
            following = _next_round(peer, rnd, plan, received)
            if following is None:
                break
            _say(f"in-place restart {following.number}: starting {len(envs)} local rank(s) again")
            _clear_termination_message()
            rnd = following
    finally:
        _drop(spares)
        for p in procs:  # anything a rank left behind in its group
            _signal_group(p, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)  # reaped; one even SIGKILL cannot stop is left to the OS rather than hang us
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if peer is not None:
            peer.close()
        if coordinator is not None:
            coordinator.close()
        if marks is not None:
            shutil.rmtree(marks, ignore_errors=True)
    code = replica_exit_code(codes)
    if rnd.abort_code is not None and not rnd.failed_here:
        code = rnd.abort_code  # our ranks were stopped because of another replica's failure: report its cause
    if code:
        _say(f"exit codes of local ranks, in the order they ended: {codes}; exiting {code}")
        if rnd.number:
            _report_rounds(rnd.number)
    return code


def _termination_log() -> str | None:
    """The container's termination-message file when there is one we may write (seqtrain.obs.progress's rule)."""
    path = os.environ.get("SEQTRAIN_TERMINATION_LOG") or "/dev/termination-log"
    return path if os.path.exists(path) and os.access(path, os.W_OK) else None


def _clear_termination_message() -> None:
    """Before an in-place restart: the last round's error line is not this round's; rank 0's final progress (which
    says the round) or the next failure's error line goes there instead."""
    path = _termination_log()
    if path is not None:
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8"):
            pass


def _report_rounds(rounds: int) -> None:
    """Say how many in-place restarts this gang made, last, in the log and the termination message."""
    line = f"{restart.ROUNDS_MARKER}{rounds}"
    print(line, file=sys.stderr, flush=True)
    path = _termination_log()
    if path is not None:
        with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
            f.write(f"\n{line}\n")


class _Round:
    """One incarnation of this replica's ranks, and what the coordinator said about it (all set by `_wait`)."""

    def __init__(self, number: int, not_before: float | None = None) -> None:
        self.number = number
        self.not_before = not_before
        self.failed_here = False  # a local rank failed (restartably) and we asked for a restart
        self.restart: dict | None = None  # the coordinator's {"restart": n, "notBefore": t}
        self.abort_code: int | None = None  # the coordinator gave up in-place restarts (the cause's code)
        self.stepped_file: str | None = None  # a local rank creates it after its first step

    def stepped(self) -> bool:
        return self.stepped_file is not None and os.path.exists(self.stepped_file)

    def take(self, msg: dict) -> None:
        if "restart" in msg and int(msg["restart"]) > self.number and self.abort_code is None:
            self.restart = msg
        elif "abort" in msg:
            _say(f"no in-place restart: {msg.get('why', '')}")
            self.abort_code = int(msg.get("code") or exitcodes.ERROR)


def _round_env(rnd: _Round, marks: str | None) -> dict[str, str]:
    """What a rank of round `rnd` gets on top of its identity (see seqtrain.runtime.restart)."""
    env = {restart.ROUND_ENV: str(rnd.number), restart.LAUNCHER_PID_ENV: str(os.getpid()),
           restart.STARTED_AT_ENV: f"{_STARTED_AT:.3f}"}
    if marks is not None:
        rnd.stepped_file = os.path.join(marks, f"stepped-{rnd.number}")
        env[restart.STEPPED_ENV] = rnd.stepped_file
    if rnd.not_before is not None:
        env[restart.NOT_BEFORE_ENV] = f"{rnd.not_before:.3f}"
    return env


def _start_rank(command: Sequence[str], env: dict[str, str], log_dir: str | None, rank: str,
                standby: bool = False) -> tuple[subprocess.Popen, int]:
    """Start one rank; `standby`: a spare that waits after its imports for the order on a pipe (returns the pipe's
    write end, else -1)."""
    out = open(os.path.join(log_dir, f"rank-{rank}.log"), "ab") if log_dir else None  # noqa: SIM115
    read = write = -1
    if standby:
        read, write = os.pipe()
        env = {**env, restart.STANDBY_ENV: str(read)}
    try:
        proc = subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                pass_fds=(read,) if standby else ())
    except OSError:
        if standby:
            os.close(write)
        raise
    finally:
        if out is not None:
            out.close()  # the child holds its own descriptor
        if standby:
            os.close(read)
    return proc, write


def _release(spares: list[tuple[subprocess.Popen, int]], order: dict[str, str]) -> list[subprocess.Popen]:
    """Send the spares their start order (this round's variables); they become the round's ranks."""
    line = (json.dumps(order) + "\n").encode()
    for _, fd in spares:
        with contextlib.suppress(OSError):
            os.write(fd, line)
        with contextlib.suppress(OSError):
            os.close(fd)
    return [p for p, _ in spares]


def _drop(spares: list[tuple[subprocess.Popen, int]]) -> None:
    """Spares no round will use: close their pipes (they exit by themselves) and make sure they are gone."""
    for p, fd in spares:
        with contextlib.suppress(OSError):
            os.close(fd)
        _signal_group(p, signal.SIGKILL)
    for p, _ in spares:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    spares.clear()


def _drain(peer: restart.Peer | None, rnd: _Round) -> None:
    while peer is not None:
        try:
            rnd.take(peer.inbox.get_nowait())
        except queue.Empty:
            return


def _next_round(peer: restart.Peer | None, rnd: _Round, plan: restart.InPlace, received: list[int]) -> _Round | None:
    """Every local rank has ended: the next round to start when the gang restarts in place, else None (exit).

    A replica restarts only through the barrier: it says it is ready for the round the coordinator announced and
    waits for every other replica to say so ("go"). A signal to the launcher, an abort, a lost coordinator or no
    answer within the barrier's deadline all end it with today's exit code."""
    if peer is None or received or not peer.connected.is_set():
        return None
    deadline = time.monotonic() + plan.barrier_seconds + FAILURE_GRACE_SECONDS
    while rnd.restart is None and rnd.abort_code is None:  # we asked: the answer comes at once unless rank 0 is gone
        if not rnd.failed_here or received or peer.lost.is_set() or time.monotonic() > deadline:
            return None
        _drain(peer, rnd)
        time.sleep(POLL_SECONDS)
    if rnd.abort_code is not None or rnd.restart is None:
        return None
    number = int(rnd.restart["restart"])
    if not peer.send({"ready": number}):
        return None
    while not received and not peer.lost.is_set() and time.monotonic() < deadline:
        try:
            msg = peer.inbox.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
        if msg.get("go") == number:
            return _Round(number, float(rnd.restart.get("notBefore") or 0) or None)
        rnd.take(msg)
        if rnd.abort_code is not None:
            return None
    return None


def _write_pids(log_dir: str, node_rank: str, pids: dict[str, int]) -> None:
    path = os.path.join(log_dir, f"replica-{node_rank}.pids")
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(pids, f)
    os.replace(tmp, path)


def _wait(procs: list[subprocess.Popen], codes: list[int], term_grace: float, failure_grace: float,
          received: list[int], peer: restart.Peer | None = None, rnd: _Round | None = None,
          after_first_step: Callable[[], None] | None = None) -> list[int]:
    """Poll until every child ended; returns their normalized codes in the order they ended (appended to `codes`).
    `after_first_step` is called once, when a rank of the round reports its first step while none has failed.

    The first non-zero exit (or a signal to the launcher) starts the stop: SIGTERM to the rest, SIGKILL at the
    deadline: `failure_grace` after a rank failure, `term_grace` after a stop request. With a `peer` (in-place
    restarts), a restartable failure is reported to the coordinator, and its restart order (another replica
    failed) stops the ranks the same way."""
    running = dict(enumerate(procs))
    rnd = rnd if rnd is not None else _Round(0)
    deadline: float | None = None if not codes else time.monotonic() + failure_grace
    if codes:
        for p in running.values():
            _signal_group(p, signal.SIGTERM)
    while running:
        for local, p in list(running.items()):
            rc = p.poll()
            if rc is None:
                continue
            del running[local]
            codes.append(normalize(rc))
            if codes[-1] != 0 and deadline is None:
                _say(f"local rank {local} exited with code {codes[-1]}; stopping the other {len(running)} rank(s)")
                deadline = time.monotonic() + failure_grace
                for q in running.values():
                    _signal_group(q, signal.SIGTERM)
                if peer is not None and not received and restart.restartable(codes[-1]) and rnd.restart is None:
                    if not rnd.stepped():
                        _say("it failed before its first step: not restarting in place (a start-up failure is the "
                             "operator's to judge)")
                    elif peer.connected.wait(peer.patience) and peer.send({"fail": rnd.number, "code": codes[-1]}):
                        rnd.failed_here = True
        if after_first_step is not None and deadline is None and rnd.stepped():
            after_first_step()
            after_first_step = None
        _drain(peer, rnd)
        if (rnd.restart is not None or rnd.abort_code is not None) and deadline is None and running:
            what = f"in-place restart {rnd.restart['restart']}" if rnd.restart is not None else "the gang gives up"
            _say(f"another replica failed ({what}): stopping the local ranks")
            deadline = time.monotonic() + failure_grace
            for q in running.values():
                _signal_group(q, signal.SIGTERM)
        if received and deadline is None:
            deadline = time.monotonic() + term_grace  # the handler already forwarded the signal
        if deadline is not None and time.monotonic() >= deadline and running:
            _say(f"local ranks {sorted(running)} still running at the deadline; SIGKILL")
            for p in running.values():
                _signal_group(p, signal.SIGKILL)
            for local, p in list(running.items()):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
                if p.returncode is not None:
                    del running[local]
                    codes.append(normalize(p.returncode))
            if running:  # unkillable (uninterruptible I/O): report it as killed rather than wait forever
                codes.extend(128 + signal.SIGKILL for _ in running)
                running.clear()
        if running:
            time.sleep(POLL_SECONDS)
    return codes


def term_grace_from(environ: Mapping[str, str]) -> float:
    raw = environ.get(GRACE_ENV, "")
    if raw == "":
        return DEFAULT_TERM_GRACE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise LaunchError(f"environment variable {GRACE_ENV}={raw!r} must be a number of seconds") from None
    if value < 0:
        raise LaunchError(f"environment variable {GRACE_ENV}={raw!r} must be >= 0")
    return value


def main(config: str, nproc: int, command: Sequence[str] | None = None) -> int:
    """`seqtrain train --config F --nproc-per-node N` with N > 1: every child runs `seqtrain train --config F`
    (`command` replaces that: tests start tiny fake ranks through the same launcher)."""
    try:
        grace = term_grace_from(os.environ)
    except LaunchError as exc:
        _say(f"invalid config: {exc}")
        return exitcodes.INVALID_CONFIG
    rank = list(command) if command else [sys.executable, "-m", "seqtrain.train.entry", "--config", config]
    return launch(rank, nproc, term_grace=grace, standby=not command)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m seqtrain.runtime.launch",
                                 description="start N rank processes of `seqtrain train` (see the module doc)")
    ap.add_argument("--config", default="")
    ap.add_argument("--nproc-per-node", type=int, required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...: run CMD as each rank instead")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd and not a.config:
        ap.error("--config or -- CMD is required")
    sys.exit(main(a.config, a.nproc_per_node, cmd or None))
