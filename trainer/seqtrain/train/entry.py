"""`seqtrain train --config FILE`: the per-rank entrypoint. Maps every ending to an exit code (exitcodes.py)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

from pydantic import ValidationError

from seqtrain.runtime import exitcodes
from seqtrain.runtime.exitcodes import DeviceUnavailable, InvalidConfig
from seqtrain.runtime.launch import apply_malloc_defaults
from seqtrain.runtime.restart import STANDBY_ENV, await_start, die_with_launcher, wait_not_before
from seqtrain.spec import SpecError, TrainerConfig, parse_job, read_trainer_config, resolve
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.memory import BASELINE_MARKER


def _load(config_path: str) -> tuple[TrainerConfig, SeqTrainJob]:
    try:
        cfg = read_trainer_config(config_path)
    except OSError as exc:
        raise InvalidConfig(f"--config {config_path}: cannot read: {exc.strerror}") from None
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidConfig(f"--config {config_path}: not a trainer config: {exc}") from None
    try:
        job = parse_job(cfg.job)
    except SpecError as err:
        raise InvalidConfig("\n".join(f"{config_path}: job: {p}" for p in err.problems)) from None
    return cfg, resolve(job)


def is_comm_timeout(exc: BaseException) -> bool:
    """A collective or rendezvous that timed out (a peer hung or vanished without closing its sockets)."""
    import torch.distributed as dist

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, dist.DistStoreError | TimeoutError):
            return True
        text = str(seen).lower()
        if "timed out" in text or "timeout" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# How gloo (and TCP under NCCL) says a peer process is gone: its side of the connection closed mid-collective.
_PEER_GONE = ("connection closed by peer", "connection reset by peer")


def is_peer_gone(exc: BaseException) -> bool:
    """A collective failed because a peer rank died (crashed, killed): the echo of another rank's failure."""
    seen: BaseException | None = exc
    while seen is not None:
        if any(marker in str(seen).lower() for marker in _PEER_GONE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def leave_error_line(exc: BaseException) -> None:
    """The rank's error line as its container's termination message (what the operator reports and `kubectl
    describe pod` shows), so the reason is never whatever the log's tail happens to hold. Only into an empty file:
    the ranks of a pod share it, and the first rank to fail is the cause (the others are stopped because of it)."""
    from seqtrain.obs.progress import termination_log

    path = termination_log()
    with contextlib.suppress(OSError):
        if os.path.isfile(path):
            with open(path, "a", encoding="utf-8") as f:
                # Under a lock: two ranks failing together both saw the file empty and both wrote (a unit test
                # flaked on it).
                fcntl.flock(f, fcntl.LOCK_EX)
                if os.fstat(f.fileno()).st_size == 0:
                    f.write(f"{exitcodes.ERROR_MARKER}{exitcodes.error_line(exc)}\n")


class _TerminateFlag:
    """SIGTERM handler target: remembers the signal until the trainer exists, then forwards it."""

    def __init__(self) -> None:
        self.received = False
        self.at: float | None = None  # monotonic time of the first SIGTERM: the grace period runs from here
        self.trainer = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        import time

        self.received = True
        self.at = self.at or time.monotonic()
        if self.trainer is not None:
            self.trainer.terminate_signal = True
            self.trainer.terminate_time = self.trainer.terminate_time or self.at

    def attach(self, trainer) -> None:  # noqa: ANN001
        self.trainer = trainer
        trainer.terminate_signal = trainer.terminate_signal or self.received
        if self.received:
            trainer.terminate_time = self.at


@contextlib.contextmanager
def lifelong_imports() -> Iterator[None]:
    """Imports whose objects live as long as the process (torch, torch._dynamo: about half a million) without the
    cyclic collector, whose scans of them as they are made cost a fifth of the imports' CPU time (0.5 s a rank on a
    2-core VM); then frozen, so no later collection scans them either. The imports' few cyclic leftovers (about
    9,000 objects, a few MiB) are kept with them."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def warm_up(job: SeqTrainJob) -> None:
    """Pay what the first set-up pays once per process: building the job's model on the meta device loads torch's
    decompositions for its initialisers (0.5-1 s on a CPU). A spare rank does it while it waits, not after the
    failure; the model built here is thrown away (on the meta device it holds no memory)."""
    import torch

    from seqtrain.models import build_model

    with contextlib.suppress(Exception), torch.device("meta"):  # only a head start: set-up reports real errors
        build_model(job.spec.model)


def main(config_path: str) -> int:
    die_with_launcher()
    # Before torch allocates anything: freed memory goes back to the OS (the launcher sets the same by environment)
    os.environ.update(apply_malloc_defaults())
    flag = _TerminateFlag()
    signal.signal(signal.SIGTERM, flag)
    ctx = None
    settle = False
    try:
        cfg, job = _load(config_path)
        main_rank = os.environ.get("RANK", "0") == "0"
        # Heavy imports only after the config is known to be good.
        with lifelong_imports():
            import torch._dynamo  # noqa: F401 (every torch.optim optimizer imports it when built: here, uncollected)

            from seqtrain.runtime.dist import init_distributed
            from seqtrain.train.callbacks import build_callbacks
            from seqtrain.train.loop import Trainer

            if main_rank:
                # Rank 0's TensorBoard writer costs 0.2-0.3 s of imports: paid here, while ranks started after it
                # still import torch, the rendezvous absorbs it; in on_train_start every rank waits for it at step 1.
                import torch.utils.tensorboard  # noqa: F401
        if os.environ.get(STANDBY_ENV):
            warm_up(job)  # a spare rank: set-up's first-use costs too, before it waits
        await_start()  # a spare rank: the imports above are done; wait here for the in-place restart
        if main_rank:
            exitcodes.announce_phase(f"rendezvous of {job.spec.world_size} rank(s)")
        ctx = init_distributed(use_gpu=job.spec.resources.gpus > 0,
                               timeout_seconds=job.spec.optimization.comm_timeout_seconds,
                               expected_world=job.spec.world_size)
        from seqtrain.train.autobatch import resident_bytes, resolve_auto

        if (held := resident_bytes()) is not None:  # the process baseline (seqtrain.spec.memory.BASELINE_BYTES)
            print(f"{BASELINE_MARKER}{held} bytes resident before the model", flush=True)

        job, auto_reason = resolve_auto(job, ctx.device, ctx.rank == 0)  # microBatchSize auto: before the model
        trainer = Trainer(job, cfg.runtime, ctx)
        trainer.auto_batch_reason = auto_reason
        flag.attach(trainer)
        from seqtrain.runtime.faults import maybe_fail_setup

        maybe_fail_setup()
        trainer.setup()
        for cb in build_callbacks(trainer):
            trainer.callbacks.append(cb)
        # An in-place restart's backoff runs out here: the ranks used it to start (imports, rendezvous, model, data,
        # checkpoint load) and train their first step after it, so it overlaps the start-up instead of adding to it.
        wait_not_before(stop=lambda: flag.received)
        reason = trainer.run()
        settle = reason != "terminated"  # finished cleanly: the peers are there to settle with (runtime.dist)
        return exitcodes.TERMINATED if reason == "terminated" else exitcodes.OK
    except InvalidConfig as exc:
        print(f"seqtrain train: invalid config:\n{exc}", file=sys.stderr, flush=True)
        leave_error_line(exc)
        return exitcodes.INVALID_CONFIG
    except DeviceUnavailable as exc:
        print(f"seqtrain train: {exc}", file=sys.stderr, flush=True)
        leave_error_line(exc)
        return exitcodes.DEVICE_UNAVAILABLE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure becomes an exit code the controller understands
        if type(exc).__name__ == "CheckpointUnavailable":  # (seqtrain.checkpoint.safe_load; imports torch)
            # could not load now (memory, device, storage): an infrastructure failure; the checkpoint is kept
            print(f"seqtrain train: checkpoint unavailable: {exc}", file=sys.stderr, flush=True)
            print(f"{exitcodes.ERROR_MARKER}{exitcodes.error_line(exc)}", file=sys.stderr, flush=True)
            return exitcodes.CHECKPOINT_UNAVAILABLE
        traceback.print_exc()
        print(f"{exitcodes.ERROR_MARKER}{exitcodes.error_line(exc)}", file=sys.stderr, flush=True)
        leave_error_line(exc)
        if exitcodes.storage_full(exc):
            return exitcodes.STORAGE_FULL
        timed_out = is_comm_timeout(exc)
        if timed_out or is_peer_gone(exc):
            # Exit 4 either way: the cause is another rank (hung or dead), whose own exit the controller reports.
            rank = ctx.rank if ctx else "?"
            from seqtrain.parallel.watchdog import current

            what = "collective communication timed out" if timed_out else "a peer rank died (its connection closed)"
            print(f"seqtrain train: rank {rank}: {what} while waiting for "
                  f"{current() or 'a collective outside the labelled phases'}", file=sys.stderr, flush=True)
            return exitcodes.COMM_TIMEOUT
        return exitcodes.ERROR
    finally:
        if ctx is not None:
            from seqtrain.runtime.dist import shutdown

            with contextlib.suppress(Exception):  # never mask the real exit code
                shutdown(ctx, settle=settle)


def leave(code: int) -> NoReturn:
    """End a rank process with `code`, without the interpreter's and C++'s static destructors: `main` has written,
    published and closed everything (checkpoints waited for, process group destroyed), and a c10d/gloo thread
    still joinable when the static destructors run aborts the process ("terminate called without an active
    exception", exit 134) instead of ending it with `code`."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--config":
        print("usage: python -m seqtrain.train.entry --config FILE", file=sys.stderr)
        sys.exit(2)
    leave(main(sys.argv[2]))
