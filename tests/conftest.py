"""Suite-wide settings: every test process (and the rank processes it starts) shares these."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.process
import os
import pathlib
import platform
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import suite_parts

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Small thread pools: the suite runs on 2 cores with several rank processes at a time.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Compiled DeepSpeed / Triton artefacts are cached across tests (and across runs in the same checkout).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / ".cache" / "triton"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Triton kernels run on the CPU through Triton's interpreter, which must be switched on before triton is first
# imported (torch imports it lazily, e.g. when an optimizer is built): once imported without it, the interpreter
# fails with "Cannot call @triton.jit'd outside of the scope of a kernel". Models keep the PyTorch reference on the
# CPU unless a test asks for kernels, so this only changes the tests that do.
_CPU_ONLY = not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidiactl")
if _CPU_ONLY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The harness's ranks (seqtrain.parallel.launch.start_ranks: parity, trainer-rank tests) fork from a server that
# imported torch once instead of each importing it (about 3 CPU-seconds a rank); SEQTRAIN_FORK_RANKS=0 executes them.
os.environ.setdefault("SEQTRAIN_FORK_RANKS", "1")
# Rank processes import the packages from the source roots, installed or not.
_pp = [str(ROOT / "trainer"), str(ROOT / "operator")]
os.environ["PYTHONPATH"] = os.pathsep.join(_pp + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

# platform.processor() runs `uname -p` the first time it is asked (then caches it): here, before any test, so a fast
# test that reports the machine does not start that process (see the cost tiers below).
platform.processor()

# Fuzz tests (marker `fuzz`) draw their example counts from one hypothesis profile: "ci" keeps `make test` within a
# few minutes; SEQTRAIN_FUZZ=long runs the longer mode documented for before a release (docs/development.md).
try:
    from hypothesis import HealthCheck
    from hypothesis import settings as _hsettings

    _hsettings.register_profile(
        "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
    )
    _hsettings.register_profile(
        "long", max_examples=20000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    _hsettings.load_profile("long" if os.environ.get("SEQTRAIN_FUZZ") == "long" else "ci")
except ImportError:  # hypothesis is a dev dependency; a bare install still collects the other tests
    pass


# Cost tiers. A test is `slow` when it starts a process: subprocess, os.fork/spawn, multiprocessing (torch's
# included), and so every testbed, control plane, helm or kubectl call. The fast tier (`-m "not slow"`,
# `make test-fast`) must start none, so during a fast test's setup and call each way to start one raises, and a
# test that swallowed the error still fails: mark it (or its module, `pytestmark = pytest.mark.slow`) `slow`.
# Threads that were running before the test (a session fixture's, e.g. an operator thread) may still start theirs,
# and so may a module being imported: the first `import torch` probes libraries with ldconfig (ctypes.util), wherever
# a test happens to import it first.
# Enforced on CPU-only machines (CI's): with a GPU, Triton compiles each kernel with ptxas and a C compiler, processes
# that the GPU tests (`-m gpu`) and any test running a kernel there start.
_PROCESS_STARTERS = (
    ("subprocess.Popen._execute_child", subprocess.Popen, "_execute_child"),
    ("os.fork", os, "fork"),
    ("os.forkpty", os, "forkpty"),
    ("os.posix_spawn", os, "posix_spawn"),
    ("os.posix_spawnp", os, "posix_spawnp"),
    ("multiprocessing Process.start", multiprocessing.process.BaseProcess, "start"),
)


class StartsAProcess(RuntimeError):
    """A test outside the slow tier started a process."""


def _importing() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == "<frozen importlib._bootstrap>":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _no_processes(nodeid: str) -> Iterator[list[str]]:
    started: list[str] = []
    others = {t.ident for t in threading.enumerate()} - {threading.main_thread().ident}

    def refuse(what: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def starter(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() in others or _importing():
                return original(*args, **kwargs)
            started.append(what)
            raise StartsAProcess(
                f"{nodeid} starts a process ({what}): mark it `slow` (tests that start processes, control planes "
                "or helm are the slow tier; tests/conftest.py)"
            )

        return starter

    saved = [(what, owner, attr, getattr(owner, attr)) for what, owner, attr in _PROCESS_STARTERS
             if hasattr(owner, attr)]
    for what, owner, attr, original in saved:
        setattr(owner, attr, refuse(what, original))
    try:
        yield started
    finally:
        for _, owner, attr, original in saved:
            setattr(owner, attr, original)


def _fast_tier_phase(item: pytest.Item) -> Iterator[None]:
    if not _CPU_ONLY or item.get_closest_marker("slow") is not None:
        return (yield)
    with _no_processes(item.nodeid) as started:
        result = yield
    if started:
        raise StartsAProcess(f"{item.nodeid} starts a process ({started[0]}): mark it `slow` (tests/conftest.py)")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _fast_tier_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _fast_tier_phase(item))


# The parts of `make test` (docs/development.md, "How long `make test` takes"): the tests on a control plane
# (marked `control_plane`: every test using the `testbed` fixture, and the modules that start their own) run in
# pytest processes of their own, in order, as they share a testbed and its operator; the rest run in one more
# process beside them. With SEQTRAIN_CP_SHARD=K/N (scripts/test-halves.sh; each process has a testbed of its own,
# TESTBED_DIR) a process keeps the control-plane modules of shard K (tests/suite_parts.py).
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "testbed" in getattr(item, "fixturenames", ()) and item.get_closest_marker("control_plane") is None:
            item.add_marker(pytest.mark.control_plane)
    shard = os.environ.get("SEQTRAIN_CP_SHARD", "")
    if not shard:
        return
    parsed = suite_parts.shard_of(shard)
    if parsed is None:
        raise pytest.UsageError(f"SEQTRAIN_CP_SHARD={shard!r}: expected K/N with 1 <= K <= N (scripts/test-halves.sh)")
    k, n = parsed
    on_cp = [item for item in items if item.get_closest_marker("control_plane") is not None]
    mine = set(suite_parts.cp_shards(sorted({item.nodeid.split("::")[0] for item in on_cp}), n)[k - 1])
    others = [item for item in on_cp if item.nodeid.split("::")[0] not in mine]
    if others:
        config.hook.pytest_deselected(items=others)
        gone = {id(item) for item in others}
        items[:] = [item for item in items if id(item) not in gone]


# Where the wall time goes (docs/development.md, "Where the suite's time goes"): with SEQTRAIN_TEST_PROFILE=FILE, a
# thread samples the main thread's stack four times a second and charges each sample to the running test, the
# innermost lines of test code on the stack (a helper's, then its callers'), and the Python function it is in
# (time.sleep in a poll, a subprocess, helm...). scripts/test-profile.py sums FILE. Off by default: it costs a
# thread and a little CPU.
_PROFILE = os.environ.get("SEQTRAIN_TEST_PROFILE")
_TESTS = str(ROOT / "tests") + os.sep


_SAMPLES: dict[tuple[str, str, str], int] = {}
_PERIOD = 0.25


def _write_profile() -> None:
    out = pathlib.Path(_PROFILE or "")
    rows = (f"{n * _PERIOD:.2f}\t{t}\t{s}\t{leaf}" for (t, s, leaf), n in list(_SAMPLES.items()))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    tmp.replace(out)


def _sample_forever(main_ident: int) -> None:
    import time

    last_write = time.monotonic()
    while True:
        time.sleep(_PERIOD)
        frame = sys._current_frames().get(main_ident)
        test = os.environ.get("PYTEST_CURRENT_TEST") or "-"  # "path::name (setup|call|teardown)"
        site, leaf = "-", "-"
        if frame is not None:
            leaf = f"{frame.f_code.co_name} ({pathlib.Path(frame.f_code.co_filename).name})"
            lines: list[str] = []  # the three innermost lines of test code: a helper's, its caller's, ...
            while frame is not None and len(lines) < 3:
                if frame.f_code.co_filename.startswith(_TESTS):
                    lines.append(f"{frame.f_code.co_filename[len(_TESTS):]}:{frame.f_lineno} {frame.f_code.co_name}")
                frame = frame.f_back
            site = " < ".join(lines) or "-"
        _SAMPLES[(test, site, leaf)] = _SAMPLES.get((test, site, leaf), 0) + 1
        if time.monotonic() - last_write > 60:  # a run killed midway still leaves its profile
            last_write = time.monotonic()
            _write_profile()


def pytest_sessionstart(session: pytest.Session) -> None:
    if _PROFILE:
        threading.Thread(target=_sample_forever, args=(threading.main_thread().ident,),
                         name="seqtrain-test-profile", daemon=True).start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _PROFILE:
        _write_profile()
