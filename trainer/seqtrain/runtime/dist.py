"""Process-group bootstrap from the pod-style environment and the context every component receives.

Environment (set by the local backend or the pod): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. Without WORLD_SIZE (or with 1) the trainer runs as a single process and no process
group is created; the collective helpers below are then no-ops, so callers never branch on world size.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from seqtrain.runtime.exitcodes import DeviceUnavailable, InvalidConfig
from seqtrain.runtime.launch import cuda_alloc_env


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # "gloo" / "nccl"; None when single-process without a process group
    # Parallel groups (None = the default world group). The spine is pure data parallel: dp = world.
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    pp_rank: int = 0
    pp_size: int = 1
    pp_group: Any = None
    mesh: Any = None  # torch DeviceMesh once tp/pp land

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def slow_barrier_group(self, timeout_s: float) -> Any:
        """A gloo group with its own timeout, for barriers that wait on storage (checkpoint I/O), not on peers:
        a save slower than the collective timeout must not end the gang. Collective: call it on every rank in the
        same order (the checkpoint manager does, once, when it is built). None without a process group."""
        if not self.distributed:
            return None
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def all_reduce(self, t: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
        """In-place all-reduce (sum / max / min); returns t for chaining."""
        if self.distributed:
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(t, op=ops[op], group=group)
        return t

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def _env_int(name: str, default: int | None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise InvalidConfig(f"environment variable {name} is required when WORLD_SIZE > 1")
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidConfig(f"environment variable {name}={raw!r} must be an integer") from None


def init_distributed(use_gpu: bool, timeout_seconds: int = 600, expected_world: int | None = None) -> DistContext:
    """Read the environment, pick the device and backend, create the process group (world > 1).

    `expected_world`: the job's replicas x processesPerReplica; a launcher that disagrees is a config error."""
    world = _env_int("WORLD_SIZE", 1)
    if expected_world is not None and world != expected_world:
        raise InvalidConfig(
            f"WORLD_SIZE={world} but the job needs replicas x processesPerReplica = {expected_world} rank processes; "
            "start one process per rank with matching RANK/WORLD_SIZE"
        )
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank if world > 1 else 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if not 0 <= rank < world:
        raise InvalidConfig(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    if use_gpu:
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"spec.resources.gpus > 0 but this process sees no CUDA device on node "
                                    f"{os.environ.get('NODE_NAME', '?')} (driver or device plugin fault?)")
        count = torch.cuda.device_count()
        # one rank per GPU: two ranks on one GPU would share its memory and stream (and NCCL refuses it)
        if max(local_rank + 1, local_world if os.environ.get("LOCAL_WORLD_SIZE") else 1) > count:
            raise InvalidConfig(f"{local_world} ranks on this node but it has {count} CUDA device(s) "
                                f"(LOCAL_RANK={local_rank}): set spec.resources.processesPerReplica "
                                f"(--nproc-per-node) to at most {count}, one rank per GPU")
        for name, value in cuda_alloc_env(os.environ).items():  # before the first CUDA allocation reads it
            os.environ[name] = value
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    ctx = DistContext(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                      device=device, dp_rank=rank, dp_size=world)
    if world > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise InvalidConfig(f"environment variable {name} is required when WORLD_SIZE > 1")
        ctx.backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=ctx.backend,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_seconds),
            device_id=device if device.type == "cuda" else None,
        )
    return ctx


def shutdown(ctx: DistContext, settle: bool = False) -> None:
    """Destroy the process group. `settle` (a rank that finished cleanly): first a barrier, so no rank tears its
    gloo pairs down while a peer still uses them; that peer dies of std::terminate (SIGABRT, exit 134, "terminate
    called without an active exception"), which failed a finished elastic gang in CI. Not after a failure or
    SIGTERM: a peer may be gone, and the barrier would wait out the collective timeout. A barrier that fails
    (a peer lost right there) is that peer's exit code's to report."""
    if ctx.distributed and dist.is_initialized():
        if settle:
            with contextlib.suppress(Exception):
                dist.barrier()
        dist.destroy_process_group()
