"""Atomic checkpoint publishing and pruning.

Protocol: rank 0 creates `<dir>/.tmp-step-N/`; barrier; every rank writes its files and fsyncs them; barrier;
rank 0 writes `meta.json` (step, time, world, layout, files), renames the folder to `step-N` (an atomic rename
on one filesystem) and prunes to `keep`; barrier. A crash at any point leaves either the previous complete
checkpoints only, or a `.tmp-*` folder that discovery ignores and the next save removes.

Layout-independent state (`state`, see `seqtrain.checkpoint.dcp_format`) is one DCP folder `state/` in the step
folder. With `background=True` (`checkpoint.asyncSave`) the save blocks training only to write the small files and
stage the state in host memory; a writer thread, or with SEQTRAIN_CHECKPOINT_WRITER=process a writer process per
rank (`seqtrain.checkpoint.writer`; a state it cannot take falls back to the thread), then writes the DCP folder
(collectives on a gloo group of its own, never used by the training thread) and rank 0, once DCP's metadata is
written (which waits for every rank's chunks), publishes exactly as above. The next save (and the end of training,
`wait`) waits for it first; a crash before the rename leaves `.tmp-step-N/` and the previous checkpoint stays the
latest. `last_block_seconds` is what training waited (`last_wait_seconds` of it for the previous background write),
`last_save_seconds` the whole save.
Async saves stage into host buffers kept from one save to the next (`dcp_format.Stager`, pinned on a GPU, in shared
memory for the writer process). `close()` stops the writer process (the trainer calls it at the end of a run).

The barriers of a save wait on storage, not on peers, so they run on a gloo group of their own whose timeout is
SEQTRAIN_CHECKPOINT_TIMEOUT_SECONDS (default: the larger of 1800 s and the collective timeout): a save slower than
`optimization.commTimeoutSeconds` does not end the gang. meta.json records every file's size and sha256.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from seqtrain.checkpoint import writer as writers
from seqtrain.checkpoint.discovery import (
    BAD_PREFIX,
    KEEP_BAD,
    REASON_FILE,
    TMP_PREFIX,
    CheckpointInfo,
    problem,
    published,
    read_complete,
    remove_tree,
    step_dir,
    verify_hashes,
)
from seqtrain.checkpoint.publish import Publisher, fsync_path, prune, publish
from seqtrain.runtime import faults
from seqtrain.runtime.exitcodes import InvalidConfig
from seqtrain.runtime.launch import free_port

if TYPE_CHECKING:
    from seqtrain.runtime.dist import DistContext


TIMEOUT_ENV = "SEQTRAIN_CHECKPOINT_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_SECONDS = 1800.0


def io_timeout_seconds(comm_timeout_s: float, environ: dict[str, str] | None = None) -> float:
    """How long a checkpoint save's barriers wait for the slowest rank's storage (see the module docstring)."""
    raw = (os.environ if environ is None else environ).get(TIMEOUT_ENV, "").strip()
    if not raw:
        return max(DEFAULT_TIMEOUT_SECONDS, float(comm_timeout_s))
    try:
        value = float(raw)
    except ValueError:
        raise InvalidConfig(f"environment variable {TIMEOUT_ENV}={raw!r} must be a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise InvalidConfig(f"environment variable {TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def writer_kind(environ: dict[str, str] | None = None) -> str:
    """What writes an async save's state: "thread" (default) or "process" (SEQTRAIN_CHECKPOINT_WRITER). The process
    is opt-in until a GPU measures it: on the 2-core CPU VM it made no clear difference (docs/benchmarks.md), and a
    pod's default /dev/shm (1Gi) holds few states."""
    raw = (os.environ if environ is None else environ).get(writers.WRITER_ENV, "").strip() or "thread"
    if raw not in writers.KINDS:
        raise InvalidConfig(f"environment variable {writers.WRITER_ENV}={raw!r} must be one of {list(writers.KINDS)}")
    return raw


def _write_reason(folder: str, reason: str) -> None:
    """REASON in `folder`, never through a link planted there (O_NOFOLLOW on a fresh file)."""
    path = os.path.join(folder, REASON_FILE)
    if os.path.islink(path) or os.path.isdir(path):
        if os.path.isdir(path) and not os.path.islink(path):
            remove_tree(path)
        else:
            os.unlink(path)
    elif os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(reason + "\n")


class CheckpointManager:
    def __init__(self, directory: str, keep: int, ctx: DistContext, io_timeout_s: float | None = None,
                 writer: str | None = None) -> None:
        self.directory = directory
        self.keep = keep
        self.ctx = ctx
        self.io_timeout_s = io_timeout_s if io_timeout_s is not None else DEFAULT_TIMEOUT_SECONDS
        self._io_group = ctx.slow_barrier_group(self.io_timeout_s)  # collective: every rank builds a manager
        self._last_save_seconds: float | None = None  # measured; SIGTERM saves only when the grace period allows
        self.last_block_seconds: float | None = None  # how long the last save held training up (sync: all of it)
        self.last_wait_seconds: float | None = None  # of which waiting for the previous background write
        self._stager: Any = None  # dcp_format.Stager of async saves: host buffers kept from one save to the next
        # background writes: a group of their own, so their collectives never interleave with the training thread's
        self._write_group = ctx.slow_barrier_group(self.io_timeout_s)
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        # the writer process (`writer`: "process" | "thread", default SEQTRAIN_CHECKPOINT_WRITER): started by the
        # first background save; `_thread_reason` says why this run writes in a thread instead
        self.writer_kind = writer or writer_kind()
        if self.writer_kind not in writers.KINDS:
            raise ValueError(f"writer must be one of {list(writers.KINDS)}, not {self.writer_kind!r}")
        self._process: writers.ProcessWriter | None = None
        self._thread_reason: str | None = (None if self.writer_kind == "process" else
                                            "the default; SEQTRAIN_CHECKPOINT_WRITER=process for a writer process")
        # the write in flight: (monotonic at the save's start, monotonic and epoch seconds when it was handed over)
        self._write_started: tuple[float, float, float] | None = None
        # (start, end) epoch seconds of the last background write, once it is done (benchmarks: overlapping steps)
        self.last_write_window: tuple[float, float] | None = None
        # Steps never pruned, whatever `keep` says (the best checkpoint by validation loss, see seqtrain.obs).
        self.protected: set[int] = set()
        # Whether every rank sees the folder rank 0 creates: found out by the first save (None: not yet).
        self.shared: bool | None = None
        if ctx.is_main:
            os.makedirs(directory, exist_ok=True)

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint to resume from, the same on every rank (collective: call it on all ranks).

        Rank 0 decides and broadcasts its choice, so ranks never resume from different steps even if their
        views of the folder differ (a slow shared filesystem); a rank that cannot read the chosen one fails."""
        answer: tuple[str, str | None] = ("ok", None)
        mine = None
        if self.ctx.is_main:
            try:
                mine = self._newest_usable()
                answer = ("ok", mine.path if mine else None)
            except OSError as exc:  # reading the files (hashes) failed: the storage's fault, keep the checkpoint
                answer = ("unavailable", f"{exc.filename or self.directory}: could not be read now "
                          f"({exc.strerror or exc}); the checkpoint is kept and the gang restarts to try again")
        kind, path = self.ctx.broadcast_object(answer)
        if kind == "unavailable":
            from seqtrain.checkpoint.safe_load import CheckpointUnavailable  # imports torch: only here

            raise CheckpointUnavailable(path)
        if path is None:
            return None
        info = mine if self.ctx.is_main else read_complete(path)
        if info is None:
            raise RuntimeError(f"rank {self.ctx.rank}: checkpoint {path} chosen by rank 0 is not complete here; "
                               "checkpoint.path must be storage that every rank shares")
        return info

    def _newest_usable(self) -> CheckpointInfo | None:
        """Rank 0: the newest published checkpoint that passes the file checks; newer ones that fail them (a file
        truncated, replaced or missing since it was published) are set aside with the reason."""
        for step, path in reversed(published(self.directory)):
            # the hashes recorded at publish time: a same-size bit flip is caught here (an I/O error reading the
            # files is the storage's fault and propagates: the checkpoint is kept)
            why = problem(path) or verify_hashes(path)
            if why is None:
                return read_complete(path)
            self._set_aside(step, why)
        return None

    def latest_published_step(self) -> int | None:
        done = published(self.directory)
        return done[-1][0] if done else None

    def quarantine(self, info: CheckpointInfo, reason: str) -> None:
        """Set a checkpoint aside as unusable (collective: rank 0 renames it, every rank waits)."""
        if self.ctx.is_main:
            self._set_aside(info.step, reason)
        self.ctx.barrier()

    def _set_aside(self, step: int, reason: str) -> None:
        # `.bad-step-N/` is never picked again (discovery reads only step-N) and keeps the files for inspection;
        # REASON is what the run's events report.
        bad = os.path.join(self.directory, f"{BAD_PREFIX}{step}")
        remove_tree(bad)
        os.rename(step_dir(self.directory, step), bad)
        _write_reason(bad, reason)
        fsync_path(self.directory)
        self._prune_bad()
        print(f"seqtrain: warning: checkpoint step-{step} skipped: {reason} (set aside as {bad})", flush=True)

    def _prune_bad(self) -> None:
        """Keep the newest KEEP_BAD `.bad-step-*` folders (each holds a whole checkpoint) for inspection."""
        bad = sorted(int(n[len(BAD_PREFIX):]) for n in os.listdir(self.directory)
                     if n.startswith(BAD_PREFIX) and n[len(BAD_PREFIX):].isdigit())
        for step in bad[: max(0, len(bad) - KEEP_BAD)]:
            remove_tree(os.path.join(self.directory, f"{BAD_PREFIX}{step}"))

    def _io_barrier(self) -> None:
        if self._io_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self._io_group)

    @property
    def last_save_seconds(self) -> float | None:
        """The last save's whole duration, background write included (once it is done)."""
        self._collect(block=False)
        return self._last_save_seconds

    @last_save_seconds.setter
    def last_save_seconds(self, value: float | None) -> None:
        self._last_save_seconds = value

    @property
    def writing_in(self) -> str:
        """Where background writes run: "process", or "thread" (and why)."""
        return "process" if self._thread_reason is None else f"thread ({self._thread_reason})"

    def _collect(self, block: bool) -> None:
        """The writer process's answer for the write in flight, if it is there (or `block`: wait for it)."""
        if self._process is None or not self._process.pending:
            return
        answer = self._process.result(block)
        if answer is None:
            return
        kind, value = answer
        started, handed, wall = self._write_started or (time.monotonic(), time.monotonic(), time.time())
        if kind == "done":
            self._last_save_seconds = value - started
            self.last_write_window = (wall, wall + (value - handed))
        else:
            self._write_error = value
            if not self.ctx.distributed and not self._process.alive():  # one rank alone: the next background save
                self._process.close()  # starts another (with peers, `_use_process` ends the save on every rank)
                self._process = None

    def wait(self) -> None:
        """Block until the background write of the previous save (if any) is published; re-raise its failure."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self._collect(block=True)
        if self._write_error is not None:
            exc, self._write_error = self._write_error, None
            if not isinstance(exc, Exception):  # DCP's CheckpointException is a BaseException: the trainer's entry
                raise RuntimeError(f"checkpoint write failed: {exc}") from exc  # maps Exceptions to exit codes
            raise exc

    def close(self) -> None:
        """Wait for the write in flight (re-raising its failure), then stop the writer process: no process is left
        once training ends. The next background save would start another."""
        try:
            self.wait()
        finally:
            if self._process is not None:
                self._process.close()
                self._process = None

    def _use_process(self, tree: dict[str, Any], step: int) -> bool:
        """Whether this background save of `tree` (not staged yet) goes to the writer process (collective on the first
        background save: every rank decides the same, or their writes would never meet). Otherwise the thread, said
        in one line. Raises on every rank when a rank's writer died while idle (see below)."""
        if self._thread_reason is not None:
            return False
        started = self._process is not None
        alive = self._process is not None and self._process.alive()  # a round trip: a writer being killed says no
        if self.ctx.distributed:
            import torch

            # is every rank's writer there? (one small all-reduce per background save): the others' writers, in a
            # process group with a dead one, could never write with it again, so a writer that died while idle ends
            # the save on every rank, as a dead rank would (the gang restarts from the latest checkpoint).
            # [0 dead / 1 never started / 2 alive, the lowest rank whose writer died (world: none)]
            dead = started and not alive
            there = torch.tensor([0 if dead else (2 if alive else 1), self.ctx.rank if dead else self.ctx.world_size])
            self.ctx.all_reduce(there, op="min", group=self._io_group)
            if int(there[0]) == 0:
                raise self._writer_died(int(there[1]), dead, step)
            alive = int(there[0]) == 2
        if alive:
            return True
        if self._process is not None:  # one rank alone: a new writer replaces the dead one
            self._process.close()
            self._process = None
        why = writers.unsupported(tree, self.ctx.local_world_size)
        addr, port = "127.0.0.1", 0
        if self.ctx.distributed:
            import torch.distributed as dist

            box = [free_port() if self.ctx.is_main else 0]
            dist.broadcast_object_list(box, src=0, group=self._io_group)
            addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(box[0])
        if why is None:
            try:
                self._process = writers.ProcessWriter(self.ctx.rank, self.ctx.world_size, addr, port,
                                                      self.io_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the thread still writes the checkpoint
                why = f"the writer process did not start: {type(exc).__name__}: {exc}"
        if self.ctx.distributed:
            import torch

            ok = torch.tensor([0 if why else 1])
            self.ctx.all_reduce(ok, op="min", group=self._io_group)
            if why is None and int(ok[0]) == 0:
                why = "another rank's writer process could not be used"
        if why is None:
            return True
        if self._process is not None:
            self._process.close()
            self._process = None
        self._thread_reason = why
        if self.ctx.is_main or not why.startswith("another rank"):
            print(f"seqtrain: note: rank {self.ctx.rank}: async checkpoint writes run in a thread: {why}", flush=True)
        return False

    def _writer_died(self, rank: int, mine_too: bool, step: int) -> RuntimeError:
        """The error every rank raises when rank `rank`'s writer process died while idle (and this rank's, when
        `mine_too`): one line saying whose, how, and which checkpoint a restarted gang resumes from."""
        mine = self._process.ended() if mine_too and self._process is not None else None
        how = f" ({mine})" if mine and rank == self.ctx.rank else ""
        also = f" (and that of rank {self.ctx.rank}: {mine})" if mine and rank != self.ctx.rank else ""
        latest = self.latest_published_step()
        kept = f"step-{latest} stays the latest checkpoint" if latest is not None else "no checkpoint is published yet"
        return RuntimeError(f"rank {self.ctx.rank}: the checkpoint writer process of rank {rank} died while idle{how}"
                            f"{also}: checkpoint step-{step} is not saved on any rank; {kept}")

    def save(self, step: int, write: Callable[[str], list[str]], meta: dict[str, Any] | None = None,
             state: Callable[[], dict[str, Any]] | None = None, background: bool = False) -> CheckpointInfo | None:
        """Publish checkpoint `step`. `write(tmp_dir)` runs on every rank and returns the file names it wrote;
        `state()` (collective on every rank) the layout-independent tree written as DCP into `state/`, in the
        background when `background`. None (nothing saved) when the folder is not shared by every rank (see
        `_every_rank_sees`). A background save returns the CheckpointInfo it will publish."""
        started = time.monotonic()
        self.wait()  # one save at a time: the previous one's files are published before this one starts
        self.last_wait_seconds = time.monotonic() - started
        if self.shared is False:
            return None
        tmp = os.path.join(self.directory, f"{TMP_PREFIX}{step}")
        if self.ctx.is_main:
            remove_tree(tmp)
            os.makedirs(tmp)
        self._io_barrier()
        if self.shared is None:
            self.shared = self._every_rank_sees(tmp)
            if not self.shared:
                return None
        for name in write(tmp):
            fsync_path(os.path.join(tmp, name))
        tree = state() if state is not None else None
        in_process = False
        if tree is not None and background:
            from seqtrain.checkpoint import dcp_format

            in_process = self._use_process(tree, step)
            if self._stager is None or self._stager.shared != in_process:  # shared: the writer maps the same buffers
                self._stager = dcp_format.Stager(shared=in_process)
            tree = self._stager.stage(tree)  # host copy: the next steps may update the originals
        elif tree is not None:
            from seqtrain.checkpoint import dcp_format

            dcp_format.write(tree, os.path.join(tmp, dcp_format.STATE_DIR), self._io_group)
        self._io_barrier()  # waits for the slowest rank's storage: the I/O deadline, not the collective one
        final = step_dir(self.directory, step)
        if tree is not None and background:
            self._write_started = (started, time.monotonic(), time.time())
            if in_process:
                assert self._process is not None
                self._process.submit(step, tmp, tree, self._stager.buffers,
                                     self._publisher() if self.ctx.is_main else None, meta)
            else:
                self._writer = threading.Thread(target=self._write_behind, args=(step, tmp, tree, meta, started),
                                                name=f"seqtrain-checkpoint-{step}", daemon=True)
                self._writer.start()
            self.last_block_seconds = time.monotonic() - started
            return CheckpointInfo(step=step, path=final, meta=dict(meta or {}))
        faults.in_save(step, self.ctx.rank)
        if self.ctx.is_main:
            self._publish(step, tmp, meta)
        self._io_barrier()
        self.last_save_seconds = self.last_block_seconds = time.monotonic() - started
        info = read_complete(final)
        if info is None:
            raise RuntimeError(f"checkpoint {final} is not readable right after publishing it")
        return info

    def _write_behind(self, step: int, tmp: str, tree: dict[str, Any], meta: dict[str, Any] | None,
                      started: float) -> None:
        """The background half of a save: write the staged state, then rank 0 publishes (DCP's save returns on
        rank 0 only after every rank's chunks and the metadata are written)."""
        from seqtrain.checkpoint import dcp_format

        try:
            dcp_format.write(tree, os.path.join(tmp, dcp_format.STATE_DIR), self._write_group)
            faults.in_save(step, self.ctx.rank)
            if self.ctx.is_main:
                self._publish(step, tmp, meta)
            self.last_save_seconds = time.monotonic() - started
            self.last_write_window = (self._write_started or (0.0, 0.0, time.time()))[2], time.time()
        except BaseException as exc:  # re-raised on the training thread by the next wait()
            self._write_error = exc

    def _publisher(self) -> Publisher:
        return Publisher(self.directory, self.keep, self.ctx.world_size, frozenset(self.protected))

    def _publish(self, step: int, tmp: str, meta: dict[str, Any] | None) -> None:
        """Rank 0: meta.json (sizes and sha256 of every file), then the atomic rename and pruning."""
        publish(self._publisher(), step, tmp, meta)

    def _every_rank_sees(self, tmp: str) -> bool:
        """Collective: does every rank see the folder rank 0 just created? Not when each replica has its own
        storage (a Kubernetes job without spec.checkpoint.pvc: every pod's emptyDir is its own). A checkpoint there
        could never be complete (rank 0's folder lacks the other ranks' files, theirs lacks the folder), and the
        other ranks would crash writing into a folder they cannot see, at every save, attempt after attempt. So the
        run goes on without checkpoints, saying so once, and a restarted gang starts from scratch."""
        import torch

        mine = os.path.isdir(tmp)
        seen = torch.tensor([1 if mine else 0], device=self.ctx.device)
        shared = bool(self.ctx.all_reduce(seen, op="min")[0] > 0)
        if not shared:
            if self.ctx.is_main:
                remove_tree(tmp)
            if self.ctx.is_main or not mine:
                print(f"seqtrain: warning: rank {self.ctx.rank}: the checkpoint folder {self.directory} is not shared "
                      "by every rank (some rank does not see the folder rank 0 creates there): no checkpoints are "
                      "saved in this run, and a restarted gang starts from scratch; put checkpoint.path on storage "
                      "every rank shares (on Kubernetes: spec.checkpoint.pvc, a ReadWriteMany claim)", flush=True)
        return shared

    def prune(self) -> None:
        """Keep the latest `keep` complete checkpoints; remove older ones and leftovers of interrupted saves."""
        prune(self._publisher())
