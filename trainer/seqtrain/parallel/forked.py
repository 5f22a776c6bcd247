"""Rank processes forked from a server that imported torch once, for the harness in seqtrain.parallel.launch (the
parity tests, the trainer's rank tests); `seqtrain.runtime.launch`, which starts the ranks of pods and of
`seqtrain run`, always executes them afresh.

Why: before its first step a rank imports torch, torch._dynamo (every torch.optim optimizer loads it), torch.distributed
and the trainer, about 3 CPU-seconds each time; the suite starts a few hundred ranks through this harness on a
2-core machine (docs/development.md, "How long `make test` takes"). multiprocessing's forkserver imports them once
(`PRELOAD`), and each rank is a fork of it: a real process with its own pid (signals, SIGSTOP and SIGKILL reach it as
they reach an executed one), environment, working directory and log, ending with the same exit code.

What a forked rank inherits instead of reading afresh: settings that libraries read while being imported. libgomp
reads OMP_NUM_THREADS when torch loads it (the rank applies its own with torch.set_num_threads), glibc its malloc
variables at exec (the rank sets the launcher's MALLOC_* with mallopt, `seqtrain.runtime.launch.set_malloc`).
Modules left out of `PRELOAD` (triton's kernels, DeepSpeed, transformers) are imported by the rank after its
environment is set, so TRITON_INTERPRET and DS_ACCELERATOR take effect as they do in an executed rank.
SEQTRAIN_FORK_RANKS=1 turns forking on (tests/conftest.py does); unset, the harness executes its ranks, and it
executes any rank whose environment differs from the server's in a variable read at import or exec (`IMPORT_TIME`).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import warnings
from collections.abc import Mapping
from multiprocessing.context import BaseContext
from pathlib import Path

from seqtrain.runtime.launch import set_malloc

ENV = "SEQTRAIN_FORK_RANKS"
RANK_MODULE = "seqtrain.train.entry"  # what `python -m` runs in an executed rank
# The imports entry.main makes before a rank's first step (and the modules they load), once, in the server. (The
# rank's entry.lifelong_imports freezes what it inherits, as it freezes what an executed rank imports.)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "seqtrain.runtime.dist", "seqtrain.train.callbacks",
           "seqtrain.train.loop", "seqtrain.train.entry", "seqtrain.parallel.forked")


# Variables read while a library is imported or a process is executed (triton's interpreter switch, torch's,
# dynamo's and inductor's settings, OpenMP's and MKL's, the loader's and glibc's, hash randomization): a rank whose
# values differ from the server's is executed instead, so it runs as it would have. (CUDA's, PYTORCH_CUDA_ALLOC_CONF
# included, are read when the rank first uses CUDA, which the server never does.)
IMPORT_TIME = ("TRITON_", "TORCH_", "TORCHDYNAMO_", "TORCHINDUCTOR_", "KMP_", "GOMP_", "MKL_", "LD_", "GLIBC_",
               "PYTHONHASHSEED")
# Read when used, not at import. Inductor writes its default cache folder into the environment of a process that
# compiles (a test compiling in the suite's own process does), which would otherwise end forking for the session.
LAZY = ("TORCHINDUCTOR_CACHE_DIR",)


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(ENV, "") == "1"


@functools.cache
def _server() -> tuple[BaseContext, dict[str, str]]:
    """The forkserver context, its server started now, and the import-time part of the environment it started with
    (this process's)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()
    return ctx, _import_time(os.environ)


def _import_time(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME) and k not in LAZY}


def forkable(env: Mapping[str, str]) -> bool:
    """The rank with environment `env` would import what the server imported with the same settings. When not, says
    which variables differ (once per set: a suite whose environment drifted executes its ranks again, slower)."""
    if not enabled(env):
        return False
    mine, server = _import_time(env), _server()[1]
    if mine != server:
        differ = sorted(k for k in {*mine, *server} if mine.get(k) != server.get(k))
        warnings.warn(f"seqtrain.parallel.forked: executing ranks whose {', '.join(differ)} differ from the fork "
                      "server's", stacklevel=2)
        return False
    return True


class ForkedRank:
    """A forked rank with the part of subprocess.Popen's interface the harness and its callers use."""

    def __init__(self, proc: multiprocessing.process.BaseProcess) -> None:
        self._proc = proc
        self.args = proc.name

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(config: Path, workdir: Path, env: Mapping[str, str], log: Path) -> ForkedRank:
    """Fork one rank of `python -m RANK_MODULE --config config` with `env` as its whole environment, in `workdir`,
    its output appended to `log`."""
    proc = _server()[0].Process(target=_rank, args=(str(config), str(workdir), dict(env), str(log)),
                              name=f"seqtrain rank {env.get('RANK', '?')}")
    proc.start()
    return ForkedRank(proc)


def _rank(config: str, workdir: str, env: dict[str, str], log: str) -> None:
    """In the fork: become the rank an exec would have started, then run it."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    # The server's streams were made for its own descriptors' kind; a rank's log is read while it runs.
    sys.stdout = os.fdopen(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(env)
    set_malloc(env)  # glibc read the server's at its exec (none): the rank's, as its exec would have
    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    sys.argv = ["-m", "--config", config]
    runpy.run_module(RANK_MODULE, run_name="__main__", alter_sys=True)  # as `python -m`: it ends the process

