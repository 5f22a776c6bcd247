"""The environment a replica starts with, whichever backend starts it: one function for both.

A replica is one pod (Kubernetes: `seqtrain_operator.k8s.pods.manifests`) or one local process group (`seqtrain run`:
`seqtrain_operator.local.gang`); it runs `seqtrain.runtime.launch.replica_command` and learns who it is only from
this environment. Torch-free, so the operator image can import it.

What differs between the backends is a parameter, each saying why:
- `master_addr`, `master_port`, `restart_port`: a pod reaches rank 0's pod by its Service DNS name on fixed ports;
  local processes use loopback and free ports (several local jobs share one machine);
- `read_only_root`: a pod's root filesystem is read-only, so HOME and the compiler caches go to /tmp;
- `omp_threads`: locally every rank of the job shares one machine's CPUs (`cpu_share(cpus, world)`); in a pod the
  launcher divides the pod's own CPU budget among its ranks (the operator cannot see the node's cgroup), so None;
- `visible_gpus`: locally each replica is shown only its own GPUs, numbered from 0; in a pod the device plugin does;
- `rank_log_dir`: a local launcher writes each rank's log and pid there; a pod's output is the container log;
- `job`: None where the backend does not name the job to its ranks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

GRACE_ENV = "SEQTRAIN_TERM_GRACE_SECONDS"  # seqtrain.runtime.launch reads it under the same name
LOG_DIR_ENV = "SEQTRAIN_RANK_LOG_DIR"  # ditto
INPLACE_DELAYS_ENV = "SEQTRAIN_INPLACE_DELAYS"
RESTART_PORT_ENV = "SEQTRAIN_RESTART_PORT"
# A multi-rank replica's launcher stops waiting for its ranks this long before the replica is SIGKILLed (the
# kubelet's grace period, or the local backend's stop deadline), so it can still kill them itself and exit with a
# code that says what happened; a trainer saves on SIGTERM only when its last save fits in what is left.
TERM_GRACE_MARGIN_SECONDS = 5
# What a replica's launcher (seqtrain.runtime.launch) prints when one of its ranks ends badly, in the order they end.
RANK_EXIT = re.compile(r"seqtrain launch: local rank (\d+) exited with code (\d+)")
# Never asked of a process: its identity comes from this environment only, not from the one it was started from.
IDENTITY = ("RANK", "LOCAL_RANK", "NODE_RANK")


def term_grace_seconds(grace_period: float) -> float:
    """SEQTRAIN_TERM_GRACE_SECONDS for a replica SIGKILLed `grace_period` seconds after its SIGTERM."""
    return max(1, grace_period - TERM_GRACE_MARGIN_SECONDS)


def cpu_share(cpus: int, ranks: int) -> int:
    """Threads per rank when `ranks` ranks share `cpus` CPUs: each its part, never none."""
    return max(1, cpus // max(1, ranks))


def replica_env(*, replica: int, attempt: int, world_size: int, procs: int, master_addr: str, master_port: int,
                grace_period: float, job: str | None = None, read_only_root: bool = False,
                omp_threads: int | None = None, visible_gpus: Sequence[int] | None = None,
                rank_log_dir: str | None = None, in_place_delays: tuple[float, ...] = (),
                restart_port: int | None = None, compile_cache_dir: str | None = None) -> dict[str, str]:
    """The variables replica `replica` of attempt `attempt` starts with, in a fixed order. RANK and LOCAL_RANK only
    for a replica of one rank (several ranks get theirs from the launcher); the in-place restart variables only
    with `in_place_delays` (then `restart_port` is required: replica 0's launcher coordinates there).
    `compile_cache_dir`: where torch.compile's and Triton's caches live when they should outlast the pod (a GPU job's
    checkpoint volume: a re-created gang finds its kernels compiled, and recovery time is goodput)."""
    env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world_size)}
    if procs == 1:
        env |= {"RANK": str(replica), "LOCAL_RANK": "0"}
    env |= {"NODE_RANK": str(replica), "LOCAL_WORLD_SIZE": str(procs)}
    if job is not None:
        env["SEQTRAIN_JOB"] = job
    env |= {"SEQTRAIN_ATTEMPT": str(attempt), "SEQTRAIN_REPLICA": str(replica), "PYTHONUNBUFFERED": "1"}
    if read_only_root:
        env |= {"HOME": "/tmp", "TRITON_CACHE_DIR": "/tmp/triton", "TORCH_EXTENSIONS_DIR": "/tmp/torch_extensions"}
    if compile_cache_dir is not None:
        env |= {"TRITON_CACHE_DIR": f"{compile_cache_dir}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{compile_cache_dir}/inductor"}
    env[GRACE_ENV] = f"{term_grace_seconds(grace_period):g}"
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    if visible_gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in visible_gpus)
    if rank_log_dir is not None:
        env[LOG_DIR_ENV] = rank_log_dir
    if in_place_delays:
        if restart_port is None:
            raise ValueError("replica_env: in_place_delays needs restart_port (replica 0's coordinator port)")
        env |= {INPLACE_DELAYS_ENV: ",".join(f"{d:g}" for d in in_place_delays),
                RESTART_PORT_ENV: str(restart_port)}
    return env


def first_rank_exit(text: str | None) -> tuple[int, int] | None:
    """(local rank, exit code) of the first rank a replica's launcher reported ending badly in `text` (its log,
    or a pod's termination message that fell back to it); None when it reported none."""
    found = RANK_EXIT.search(text or "")
    return (int(found.group(1)), int(found.group(2))) if found else None
