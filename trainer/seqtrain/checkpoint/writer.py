"""The background half of an async save in a process of its own, one per rank (`checkpoint.asyncSave`).

A writer *thread* shares the training process's interpreter lock: on an H100 the steps that overlapped a background
write ran 6.5x slower (0.489 s vs 0.075 s, 350m preset, 3.7 GB), the thread's serialization and hashing taking the
lock from a training loop that is itself Python-bound (kernel launches). A process has a lock of its own.

How it works. `Stager(shared=True)` stages the state into shared-memory buffers (pinned on a GPU), kept from one save
to the next. The first background save spawns the writer (multiprocessing "spawn": no fork of a process holding
CUDA and gloo threads) and hands it those buffers once (file descriptors); later saves send only the tree's shape
with references to the buffers, plus any buffer re-allocated since (a tensor that changed shape). The writer runs
`torch.distributed.checkpoint.save` on a gloo process group of the writers alone (rank 0's writer hosts its
TCPStore on a free port beside MASTER_ADDR, chosen by rank 0 and broadcast on the manager's I/O group), then
`faults.in_save`, then on rank 0 the publish (meta.json with sizes and sha256, atomic rename, pruning: the hashing
too is off the training process), and answers "done" or the exception. The training process does nothing
meanwhile; `CheckpointManager.wait` reads the answer (and a dead writer's exit) from the pipe.

Why not DCP's own `async_save(async_checkpointer_type=PROCESS)` (torch 2.11 and 2.13 have the same code): it needs
an initialized default process group (a single-process run has none), keeps one module-global daemon per process
with no way to stop it but `__del__`/interpreter exit (our ranks end with os._exit), pickles the staged dict through
its pipe at every save, and publishes nowhere: our meta.json hashing and atomic rename would run back in the
training process. The writer still uses DCP's `save` (format, planner, resharding on load) unchanged.

Lifetime. The writer dies with its rank: PR_SET_PDEATHSIG (Linux) kills it when the thread that spawned it (the
training thread) ends, so a rank SIGKILLed mid-write never publishes later, and `os._exit` at the end of a rank
leaves no orphan. `close()` stops it (after the write in flight) and joins it. Whether an idle writer is still there
(`alive`) is asked over the pipe, not read from its sentinel or waitpid: see `ProcessWriter.alive`.

DTensors (FSDP2, tensor or pipeline parallel) travel as their local shard plus the mesh's global ranks, dimension
names, placements, global shape and stride; the writer rebuilds each on a DeviceMesh over its own process group
built without communicators (`_init_backend=False`: DCP's planner only needs this rank's coordinate in it), the
ranks of the writers being the ranks of the training processes. A torch without that argument, or a state /dev/shm
cannot hold, keeps the thread (`unsupported`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import multiprocessing.connection

    import torch

    from seqtrain.checkpoint.publish import Publisher


WRITER_ENV = "SEQTRAIN_CHECKPOINT_WRITER"  # thread (default) | process (opt-in until measured on a GPU)
KINDS = ("process", "thread")
STOP_SECONDS = 60.0  # how long close() waits for the writer to leave before killing it
ANSWER_SECONDS = 60.0  # how long an idle writer may take to answer alive(): one that does not is hung, and killed
PING, PONG = "ping", "pong"


@dataclass(frozen=True)
class _Ref:
    """A staged tensor in the tree sent to the writer: the writer's copy of buffer `key`."""

    key: str


@dataclass(frozen=True)
class _DRef:
    """A staged DTensor: buffer `key` is its local shard; the rest rebuilds it in the writer."""

    key: str
    mesh: list[Any]  # the device mesh's global ranks (nested lists, one level per mesh dimension)
    dims: tuple[str, ...] | None
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _writer_mesh(ranks: list[Any], dims: tuple[str, ...] | None) -> Any:
    """A DeviceMesh over these global ranks without communicators of its own (DCP needs none to plan a save)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=dims, _init_backend=False)


SHM = "/dev/shm"  # where torch's shared memory lives (shm_open): a pod's is spec.resources.shmSize


def unsupported(tree: Any, local_ranks: int = 1, shm: str = SHM) -> str | None:
    """Why this state tree (before staging) cannot go to a writer process; None: it can. `local_ranks`: the ranks
    on this node, each staging its own state into the same /dev/shm."""
    import torch
    from torch.distributed.tensor import DTensor

    size, dtensor = 0, None

    def walk(value: Any) -> None:
        nonlocal size, dtensor
        if isinstance(value, DTensor):
            dtensor = value if dtensor is None else dtensor
            local = value.to_local()
            size += local.numel() * local.element_size()
        elif isinstance(value, torch.Tensor):
            size += value.numel() * value.element_size()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    walk(tree)
    if dtensor is not None:
        try:  # the writer must be able to rebuild the meshes (a private torch argument): tried here first
            _writer_mesh(dtensor.device_mesh.mesh.tolist(), dtensor.device_mesh.mesh_dim_names)
        except Exception as exc:  # noqa: BLE001 - this torch cannot: the thread writes
            return f"the state holds DTensors and this torch cannot rebuild their mesh in a writer process ({exc})"
    try:
        st = os.statvfs(shm)
    except OSError:  # no /dev/shm (not Linux): torch shares memory its own way
        return None
    free, need = st.f_bavail * st.f_frsize, size * local_ranks
    # a tmpfs over its size limit kills the process that touches the page (SIGBUS), not a clean error: keep a tenth
    # free for everything else there (data loader workers, NCCL)
    if need > 0.9 * free:
        return (f"{shm} has {free / 2**30:.2f} GiB free and staging the state for the writer process needs "
                f"{need / 2**30:.2f} GiB ({local_ranks} rank(s) on this node); raise spec.resources.shmSize")
    return None


class ProcessWriter:
    """The training process's end of one rank's writer process."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout_s: float) -> None:
        import torch.multiprocessing as mp  # registers the tensor reductions: buffers travel as shared memory

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, rank, world, addr, port, timeout_s, os.getpid()),
                                 name=f"seqtrain-checkpoint-writer-{rank}", daemon=True)
        # "spawn" runs the parent's main module again in the child, unless it has no file: the writer needs nothing
        # of it, and re-running a script's top level there (one without the __main__ guard, a benchmark) would be
        # wrong and slow. Only start() reads it.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            self._proc.start()
        finally:
            sys.modules["__main__"] = main
        child.close()  # ours: recv() then ends with EOFError when the writer dies
        self._sent: dict[str, torch.Tensor] = {}  # buffers the writer holds (kept alive here too)
        self.pending = False
        self._unanswered: float | None = None  # seconds alive() waited for an answer that never came

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def alive(self, timeout_s: float = ANSWER_SECONDS) -> bool:
        """Whether the idle writer is there to take a write: it answers a ping (a round trip over the pipe).

        Not its sentinel, nor waitpid: once SIGKILLed, the writer runs no code of its own, but its last thread
        (gloo's run loop) then unmaps the address space (exit_mmap: some 30 ms with torch loaded, longer on a busy
        node) before the kernel closes the writer's files (the sentinel's pipe end among them) and lets waitpid
        reap it. In that window /proc already shows the main thread a zombie, yet the sentinel and waitpid said
        "alive", and a save right after the kill failed later, in the writers' gloo group. A killed writer never
        answers; the pipe's EOF ends the wait once that teardown is done."""
        assert not self.pending, "alive() asks an idle writer"
        try:
            self._conn.send(PING)
            if self._conn.poll(timeout_s):
                return bool(self._conn.recv() == PONG)
        except (EOFError, OSError):  # its end of the pipe is closed: it is gone
            return False
        self._unanswered = timeout_s  # a writer that cannot answer cannot write either
        self._proc.kill()
        return False

    def ended(self) -> str:
        """How the writer ended, for messages ("signal 9", "exit code 1", "no answer within 60 s")."""
        if self._unanswered is not None:
            return f"no answer within {self._unanswered:g} s, killed"
        self._proc.join(5)  # the pipe's EOF comes a moment before waitpid can reap it
        code = self._proc.exitcode
        return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"

    def submit(self, step: int, tmp: str, tree: dict[str, Any], buffers: dict[str, torch.Tensor],
               publisher: Publisher | None, meta: dict[str, Any] | None) -> None:
        """Hand the staged `tree` (whose tensors are `buffers`, by key) to the writer; returns at once."""
        by_ptr = {t.data_ptr(): k for k, t in buffers.items()}  # every buffer has a storage of its own
        new = {k: t for k, t in buffers.items() if self._sent.get(k) is not t}

        def encode(value: Any) -> Any:
            import torch
            from torch.distributed.tensor import DTensor

            if isinstance(value, DTensor):
                mesh = value.device_mesh
                return _DRef(by_ptr[value.to_local().data_ptr()], mesh.mesh.tolist(), mesh.mesh_dim_names,
                             tuple(value.placements), tuple(value.shape), tuple(value.stride()))
            if isinstance(value, torch.Tensor):
                return _Ref(by_ptr[value.data_ptr()])
            if isinstance(value, dict):
                return {k: encode(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return type(value)(encode(v) for v in value)
            return value

        drop = [k for k in self._sent if k not in buffers]
        request = {"step": step, "tmp": tmp, "tree": encode(tree), "new": new, "drop": drop, "publisher": publisher,
                   "meta": meta}
        self._conn.send(request)
        self._sent.update(new)
        for k in drop:
            del self._sent[k]
        self.pending = True

    def result(self, block: bool) -> tuple[str, Any] | None:
        """The write's outcome: ("done", monotonic end time) or ("failed", exception); None while it runs (not
        `block`). A writer that died answers ("failed", RuntimeError naming its exit)."""
        if not self.pending:
            return None
        if not block and not self._conn.poll():
            return None
        self.pending = False
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return ("failed", RuntimeError(f"the checkpoint writer process (pid {self._proc.pid}) died "
                                           f"({self.ended()}) before its write was done"))

    def close(self) -> None:
        """Stop the writer after the write in flight (if any) and join it; kill it if it does not leave."""
        with contextlib.suppress(BrokenPipeError, OSError):  # a writer already gone
            self._conn.send(None)
        self._proc.join(STOP_SECONDS)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
        self._sent.clear()


def _die_with_parent(parent: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pipe's EOF still ends an idle writer
        pass
    if os.getppid() != parent:  # the rank was gone before the line above
        os._exit(1)


def serve(conn: multiprocessing.connection.Connection, rank: int, world: int, addr: str, port: int,
          timeout_s: float, parent: int) -> None:
    """The writer process: one request at a time until None or the training process's end of the pipe closes."""
    _die_with_parent(parent)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # host buffers only: no CUDA context (GPU memory) in the writer
    import datetime

    import torch

    from seqtrain.checkpoint import dcp_format
    from seqtrain.checkpoint.publish import publish
    from seqtrain.runtime import faults

    torch.set_num_threads(1)
    group, setup_error = None, None
    if world > 1:
        import torch.distributed as dist

        try:
            timeout = datetime.timedelta(seconds=timeout_s)
            store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
            group = dist.group.WORLD
        except Exception as exc:  # noqa: BLE001 - answered to every request: the save fails, saying why
            setup_error = exc
    buffers: dict[str, torch.Tensor] = {}
    meshes: dict[str, Any] = {}

    def decode(value: Any) -> Any:
        nonlocal group
        if isinstance(value, _Ref):
            return buffers[value.key]
        if isinstance(value, _DRef):
            from torch.distributed.tensor import DTensor

            if group is None:  # one rank: a mesh needs a process group all the same
                import torch.distributed as dist

                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                group = dist.group.WORLD
            name = repr((value.mesh, value.dims))
            if name not in meshes:
                meshes[name] = _writer_mesh(value.mesh, value.dims)
            return DTensor.from_local(buffers[value.key], meshes[name], value.placements, run_check=False,
                                      shape=torch.Size(value.shape), stride=value.stride)
        if isinstance(value, dict):
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(decode(v) for v in value)
        return value

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the rank is gone
            break
        if request is None:
            break
        if request == PING:  # ProcessWriter.alive
            try:
                conn.send(PONG)
            except OSError:
                break
            continue
        try:
            if setup_error is not None:
                raise RuntimeError(f"the checkpoint writer process of rank {rank} could not join the other ranks' "
                                   f"writers at {addr}:{port}: {setup_error}")
            for key in request["drop"]:
                buffers.pop(key, None)
            buffers.update(request["new"])
            tree = decode(request["tree"])
            step, tmp = request["step"], request["tmp"]
            dcp_format.write(tree, os.path.join(tmp, dcp_format.STATE_DIR), group)
            faults.in_save(step, rank, pid=parent)  # "crash" kills the rank, as a crash of the rank would
            if request["publisher"] is not None:
                if os.getppid() != parent:  # the rank died during the write: never publish for it
                    break
                publish(request["publisher"], step, tmp, request["meta"])
            answer: tuple[str, Any] = ("done", time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training process by the next wait()
            import traceback

            print(f"seqtrain: checkpoint writer of rank {rank}: the write of step {request['step']} failed:",
                  file=sys.stderr, flush=True)
            traceback.print_exc()  # into the rank's log: the exception travels back without its traceback
            sys.stderr.flush()
            answer = ("failed", exc)
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):
            break
        except Exception as exc:  # noqa: BLE001 - an exception that does not pickle: its text then
            conn.send(("failed", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]} ({exc})")))
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # no process-group teardown: a peer writer may still be reading its last message (see seqtrain.runtime.dist)
    os._exit(0)

