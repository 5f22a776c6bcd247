"""`seqtrain bench gpu --out DIR`: everything a lent GPU must show, in one command, as JSON in DIR.

Parts, in this order (`--parts` picks a subset), each in a process of its own with its own deadline, each
writing DIR/<part>.json as soon as it ends (the MFU part also after each of its runs) and a line in
DIR/summary.json; their output goes to DIR/bench.log:
- mfu:      first, so no slow part can lose the headline figure. A GPT of about 1.3B parameters (the `1b` preset
            with 28 layers) in bf16 at sequence length 2048 on one GPU, with torch.compile. MFU = model FLOPs per
            token position (6N + attention, `seqtrain.obs.flops`) x computed positions (`slots`, padding and
            prompt positions included: the model computes them) / step time / the datasheet dense bf16 peak of
            the GPU (named in the JSON: 989.5 TFLOP/s for an H100 SXM or an H200), as nanoGPT, PaLM, Megatron and
            torchtitan report it; the measured 8192^3 bf16 matmul rate is reported beside it, not instead. Also
            whether each block ran compiled, dynamo's graphs, graph breaks and recompiles, and which attention
            kernel ran (aten op names under the profiler). At the batch people train a 1.3B model with first
            (micro-batch 4, gradient accumulation to ~0.5M tokens per optimizer step, `ACCUM_TOKENS`), then one
            optimizer step per micro-batch (`--micro-batch`, without and with full activation checkpointing) and
            micro-batch 8 with the same accumulation where it fits.
- profile:  with `--profile` (or in `--parts`): one optimizer step of the MFU model (micro-batch 4,
            `PROFILE_ACCUM` micro-batches) under torch.profiler, CUDA activities on a GPU, the CPU's otherwise:
            milliseconds by kernel class (matmul, attention, optimizer + clip, loss, pointwise, memory copies),
            the GPU's busy and idle time inside the step, and the trace, gzip-compressed, when under
            `TRACE_CAP_BYTES`.
- kernels:  `seqtrain bench kernels` at realistic shapes: each Triton kernel against what the trainer runs
            without it (SDPA with is_causal and GQA, flex_attention for packed documents, torch.compile of the
            reference), timed with `triton.testing.do_bench`.
- training: a few real training steps (the Trainer: meta build, engine, autocast) in bf16 and in fp16
            (dynamic loss scaling): loss first/last, finite, step time, loss scale.
- tests:    `pytest -m gpu` on exactly the GPU test files (`GPU_TEST_FILES`; none imports kopf or kubernetes),
            in `GPU_TEST_WORKERS` processes where pytest-xdist is installed, with a per-test timeout whose
            thread method dumps every thread's stack (a test stuck in a CUDA call included); pass/fail/skip
            counts from its JUnit XML. Without CUDA: `pytest --collect-only` of those files, and
            the count it collected.

Budget: the default parts' deadlines add up to 590 s (`DEADLINES`), which with the install and start-up is about
a lent machine's 10-minute command: docs/benchmarks.md's lease plan splits them over two calls; a part past its deadline is killed and recorded as such with what it had written. All parts share one
inductor and Triton cache folder, so what one part compiled or autotuned the next finds warm. On a machine
without CUDA every part runs as far as it can on tiny shapes (`--dry-run`, implied there): the kernels on
Triton's interpreter when triton imports, the training steps and the MFU harness on tiny models on the CPU,
the GPU tests collected, not run. Needs torch, pydantic and pyyaml (and triton, pytest for two parts); never
kopf, kubernetes or deepspeed.

    seqtrain bench gpu --out bench-gpu/                 # on the GPU machine (scripts/device-bench.sh)
    seqtrain bench gpu --out /tmp/b --dry-run           # the CPU path: exercises the code, no figures
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PARTS = ["mfu", "profile", "kernels", "training", "tests"]  # MFU first: the headline never waits on another part
DEFAULT_PARTS = ["mfu", "kernels", "training", "tests"]  # the profile runs with --profile (or --parts)
# Seconds per part on one H100/H200. Sized from the first H100 lease (2026-11-26): mfu took 51 s for its two
# one-micro-batch runs, training 17 s, kernels 126-150+ s (cold Triton cache: over 150), tests over 170 s (unknown
# how far over: that run was silent until killed). The accumulated MFU runs add two ~64-micro-batch runs of about
# 9 s per optimizer step each (estimated from the 175 ms micro-batch of that lease), compile included: 180 s.
DEADLINES = {"mfu": 180, "profile": 90, "kernels": 170, "training": 40, "tests": 200}
GPU_TEST_TIMEOUT_S = 120  # per GPU test: one test's autotuning may compile dozens of kernels
GPU_TEST_WORKERS = 4  # pytest-xdist processes on one GPU: the tests are compile-bound (CPU), not GPU-bound
NO_CUDA = "skipped: no CUDA"
REPO = Path(__file__).resolve().parents[3]  # the checkout: trainer/seqtrain/benchmarks/gpu.py
# The test files that hold the `gpu`-marked tests (tests/unit/test_bench_gpu.py checks the list is complete).
GPU_TEST_FILES = ["tests/unit/kernels/test_kernel_gpu.py", "tests/unit/test_precision.py",
                  "tests/unit/test_cuda_gpu.py", "tests/unit/test_step_syncs.py"]

# The MFU model: GPT `1b` preset (dim 2048, GQA 16/8 heads, SwiGLU 5632) deepened to 28 layers = ~1.3B.
MFU_MODEL = {"arch": "gpt", "preset": "1b", "layers": 28, "vocabSize": 32768, "maxSeqLen": 2048}
MFU_SEQ = 2048
# Tokens per optimizer step of the accumulated MFU runs: 256 sequences of 2048 (llm.c steps on 0.5-1M tokens; nobody
# trains a 1.3B model at 8k tokens per step, where the optimizer's ~28 bytes per parameter weigh on every step).
ACCUM_TOKENS = 524_288
PROFILE_ACCUM = 4  # micro-batches in the profiled optimizer step: each micro-batch's kernels, and one update
TRACE_CAP_BYTES = 12 * 2**20  # the gzip-compressed trace comes back only under this (a lease returns 16 MiB a file)
PROFILE_TRACE = "profile-trace.json.gz"


def _deadline_arg(text: str) -> tuple[str, float]:
    part, _, secs = text.partition("=")
    if part not in PARTS or not secs:
        raise argparse.ArgumentTypeError(f"expected PART=SECONDS with PART one of {', '.join(PARTS)}, got {text!r}")
    try:
        return part, float(secs)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: SECONDS must be a number") from exc


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="seqtrain bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON files (created)")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma-separated subset of: {','.join(PARTS)} (default: {','.join(DEFAULT_PARTS)})")
    p.add_argument("--profile", action="store_true",
                   help="also run the profile part, right after mfu: one optimizer step under torch.profiler")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes and few steps: exercise every code path (implied without CUDA)")
    p.add_argument("--quick", action="store_true", help="half the timed steps (GPU)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step in the MFU part (default 4)")
    p.add_argument("--deadline", type=_deadline_arg, action="append", default=[], metavar="PART=SECONDS",
                   help="override one part's deadline (repeatable); defaults on a GPU: " +
                        ", ".join(f"{k}={v}" for k, v in DEADLINES.items()) + " (the dry run has none)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole run: a part gets at most what is left of it, and one that would "
                        "start with under 5 s left is recorded as skipped (default: the sum of the chosen parts' "
                        "deadlines on a GPU; none in the dry run, whose speed says nothing about a GPU's)")
    p.add_argument("--run-part", choices=PARTS, help=argparse.SUPPRESS)  # the child process of one part
    args = p.parse_args(argv)
    unknown = [x for x in args.parts.split(",") if x not in PARTS]
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.profile and "profile" not in args.parts.split(","):
        parts = args.parts.split(",")
        parts.insert(parts.index("mfu") + 1 if "mfu" in parts else 0, "profile")
        args.parts = ",".join(parts)
    return args


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- tests ----------------------------------------------------------------------------------------------------

def _pytest_env() -> dict[str, str]:
    env = dict(os.environ)
    roots = [str(REPO / "trainer"), str(REPO / "operator")]
    env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def part_tests(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    missing = [f for f in GPU_TEST_FILES if not (REPO / f).is_file()]
    if missing:
        return {"status": f"skipped: GPU test files missing under {REPO}: {', '.join(missing)}"}
    base = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    if not _cuda():
        # The dry run: the GPU tests must at least collect here (no import error, kopf and kubernetes absent).
        cmd = [*base, "--collect-only", *GPU_TEST_FILES]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_pytest_env(), timeout=300)
        ids = [line for line in proc.stdout.splitlines() if "::" in line]
        ok = proc.returncode == 0 and ids
        return {"status": f"ok: collected {len(ids)} GPU tests ({NO_CUDA}, not run)" if ok else
                f"failed: pytest --collect-only exit {proc.returncode}", "command": " ".join(cmd[2:]),
                "collected": len(ids), "files": GPU_TEST_FILES, "tests": ids,
                "output_tail": None if ok else (proc.stdout + proc.stderr)[-3000:]}
    # pytest's output goes to bench.log as it runs (-v: one line per test, --durations: the slow ones), and
    # tests.json is rewritten after every test (pytest_progress), so a run killed at its deadline still names the
    # test that was running and the time each finished one took. A per-test timeout (pytest-timeout, which the
    # lent image has) turns a hung test into a failure with its traceback instead of the whole part's kill.
    extra = ["-v", "--durations=0", "-p", "seqtrain.benchmarks.pytest_progress"]
    extra += gpu_test_options(importlib.util.find_spec("pytest_timeout") is not None,
                              importlib.util.find_spec("xdist") is not None)
    env = {**_pytest_env(), "SEQTRAIN_PYTEST_PROGRESS": str(out / "tests.json")}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "pytest-gpu.xml"
        cmd = [*base, *extra, f"--junitxml={xml}", *GPU_TEST_FILES]
        t0 = time.perf_counter()
        sys.stdout.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=env)
        progress = json.loads((out / "tests.json").read_text()) if (out / "tests.json").exists() else {}
        res: dict[str, Any] = {"command": " ".join(cmd[2:]).replace(str(xml), "pytest-gpu.xml"),
                               "exit_code": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
                               "test_seconds": progress.get("seconds", {}), "output": "bench.log"}
        if xml.exists():
            root = ET.parse(xml).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            if suite is not None:
                res.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
                res["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                                 if c.find("failure") is not None or c.find("error") is not None]
    res["status"] = "ok" if proc.returncode == 0 else "failed"
    return res


def gpu_test_options(has_timeout: bool, has_xdist: bool) -> list[str]:
    """pytest options of the GPU tests: a per-test timeout whose thread method dumps every thread's stack and ends
    the run of a test stuck in a CUDA call (the signal method cannot interrupt one), and the tests spread over
    `GPU_TEST_WORKERS` processes, each test file kept on one worker (its module-level compiled kernels and fixtures
    are built once)."""
    opts = [f"--timeout={GPU_TEST_TIMEOUT_S}", "--timeout-method=thread"] if has_timeout else []
    return opts + (["-n", str(GPU_TEST_WORKERS), "--dist", "loadfile"] if has_xdist else [])


# ---- kernels --------------------------------------------------------------------------------------------------

KERNELS_DETAIL = "kernels-detail.json"  # written by `seqtrain bench kernels` after every row


def kernels_summary(detail: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per op and shape: the kernel's time against what the trainer runs without it."""
    return [{"op": r["op"], "shape": r["shape"], "kernel_ms": r["kernel"].get("ms"),
             "reference_ms": r["reference"].get("ms"), "compiled_ms": (r.get("compiled") or {}).get("ms"),
             "baseline": (r.get("baseline") or {}).get("name"), "baseline_ms": (r.get("baseline") or {}).get("ms"),
             "speedup_vs_baseline": _ratio((r.get("baseline") or {}).get("ms"), r["kernel"].get("ms")),
             "speedup_vs_reference": r.get("speedup"),
             "speedup_vs_compiled": _ratio((r.get("compiled") or {}).get("ms"), r["kernel"].get("ms"))}
            for r in detail.get("results", [])]


def part_kernels(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from seqtrain.benchmarks import kernels

    target = out / KERNELS_DETAIL
    if _cuda() and not args.dry_run:
        # attention first: the rows that decide the default come in before a deadline could stop the part
        ops = ["attention", "linear_cross_entropy", "rms_norm", "swiglu", "rope", "cross_entropy", "linear_scan",
               "layer_norm"]
        argv = ["--device", "cuda", "--ops", ",".join(ops), "--repeat", "5" if args.quick else "10",
                "--out", str(target)]
    else:
        try:
            import triton  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means no interpreter either
            return {"status": f"skipped: triton does not import ({type(exc).__name__})"}
        problem = interpreter_problem()
        if problem:
            return {"status": f"skipped: {problem}"}
        argv = ["--device", "cpu", "--ops", "rms_norm,attention", "--repeat", "1", "--no-accuracy",
                "--out", str(target)]
    code = kernels.main(argv)
    detail = json.loads(target.read_text()) if target.exists() else {}
    return {"status": "ok" if code == 0 else f"failed (exit {code})", "command": "seqtrain bench kernels " +
            " ".join(argv).replace(str(target), KERNELS_DETAIL), "timer": detail.get("timer"),
            "summary": kernels_summary(detail), "detail_file": target.name,
            "interpreter_fix": detail.get("interpreter_fix"),
            "note": None if _cuda() else "Triton interpreter on the CPU: times are not speeds"}


def interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run seqtrain's kernels in this environment, or None. Triton 3.6's
    interpreter turns a loop bound derived from `tl.program_id` into a Python int with `int(array)`, which
    numpy 2.5 refuses for 1-element arrays (the lent GPU machine's pair; there the kernels are compiled, not
    interpreted): `seqtrain bench kernels` patches that conversion (`patch_interpreter_for_numpy`), and a probe
    kernel with such a loop tells whether the interpreter then works."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from seqtrain.benchmarks.kernels import patch_interpreter_for_numpy

    patch_interpreter_for_numpy()  # what the kernels part's run applies too

    @triton.jit
    def probe(X, n):
        start = tl.program_id(0) * n
        for i in range(start, start + n):
            tl.store(X + i, i)

    x = torch.zeros(4, dtype=torch.int32)
    try:
        probe[(2,)](x, 2)
    except Exception as exc:  # noqa: BLE001 - any failure means the interpreter is unusable here
        return (f"Triton {triton.__version__}'s CPU interpreter fails with numpy {np.__version__} on loops over "
                f"program-id bounds ({type(exc).__name__}: {str(exc)[:120]}); the GPU compiles the kernels instead")
    return None if x.tolist() == [0, 1, 2, 3] else "Triton's CPU interpreter computes a probe kernel wrongly"


def salvage_kernels(out: Path) -> dict[str, Any]:
    """The rows a killed kernels part had written."""
    target = out / KERNELS_DETAIL
    detail = json.loads(target.read_text()) if target.exists() else {}
    return {"summary": kernels_summary(detail), "detail_file": target.name} if detail else {}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# ---- training steps through the real Trainer --------------------------------------------------------------------

def _job(model: dict[str, Any], seq: int, micro: int, steps: int, precision: str, ac: str, compile_: bool,
         global_batch: int | None = None, fused: bool = True) -> Any:
    """A one-process job; `global_batch` sequences per optimizer step (default `micro`: no accumulation); `fused`:
    optimization.fusedProjections (q/k/v and gate/up as one GEMM each)."""
    from seqtrain.spec import parse_job, resolve

    doc = {
        "apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "bench-gpu"},
        "spec": {
            "model": model,
            # copy examples of 2L + 3 tokens fill each sequence (no padding: tokens/s counts real tokens)
            "data": {"source": "synthetic", "seqLen": seq, "synthetic": {"length": (seq - 3) // 2}},
            "training": {"steps": steps, "globalBatchSize": global_batch or micro, "microBatchSize": micro, "seed": 0,
                         "logEvery": 10**6, "optimizer": {"lr": 3e-4}, "schedule": {"name": "constant"}},
            "optimization": {"precision": precision, "compile": compile_, "fusedProjections": fused,
                             "activationCheckpointing": {"policy": ac}},
            "checkpoint": {"intervalSteps": 10**6, "saveOnSigterm": False},
        },
    }
    return resolve(parse_job(doc, check_features=False))


ATTENTION_OPS = {  # aten op (as the profiler names it) -> the SDPA backend or attention path it is
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "flex_attention": "flex_attention",
}


def attention_backends(fn: Any) -> list[str]:
    """Which attention kernels run in `fn()`: the aten ops the profiler records (compiled graphs call the same
    ops as extern kernels). CPU-side events only: no CUPTI needed, little overhead."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    seen = {e.key for e in prof.key_averages()}
    return sorted({name for op, name in ATTENTION_OPS.items() if any(op == k or (op == "flex_attention" and op in k)
                                                                     for k in seen)})


@contextlib.contextmanager
def _trainer(job: Any) -> Iterator[Any]:
    """A set-up Trainer of `job` on this process's device (CUDA when there is one), its engine in train mode."""
    import torch

    from seqtrain.runtime.dist import DistContext
    from seqtrain.spec import RuntimeConfig
    from seqtrain.train.loop import Trainer

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()  # counters and graphs of this run only
    with tempfile.TemporaryDirectory() as work:
        trainer = Trainer(job, RuntimeConfig(workdir=work, checkpoint_dir=os.path.join(work, "ck")),
                          DistContext(device=device))
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's log lines are not the JSON
            trainer.setup()
        trainer.engine.train()
        yield trainer


def _run_steps(job: Any, steps: int, warmup: int, attention: bool = True) -> dict[str, Any]:
    """Run `steps` optimizer steps of `job` in this process; time the ones after `warmup` (which compile and
    autotune), then (`attention`) one more step under the profiler to see which attention kernel ran."""
    import torch

    from seqtrain.models import count_parameters
    from seqtrain.models.compile import compile_report

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with _trainer(job) as trainer:
        metrics, times = [], []
        for i in range(steps):
            _sync()
            t0 = time.perf_counter()
            m = trainer.train_step()
            _sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            metrics.append(m)
        peak_mb = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else metrics[-1]["mem_peak_mb"]
        compiled = compile_report(trainer.model) if trainer.spec.optimization.compile else None
        backends = attention_backends(trainer.train_step) if attention else None
        params = count_parameters(trainer.model)
        accumulation = trainer.spec.training.global_batch_size // trainer.spec.training.micro_batch_size
        del trainer
    step_s = statistics.median(times) if times else None
    tokens, slots = metrics[-1]["tokens"], metrics[-1]["slots"]
    return {"params": params, "steps": steps, "warmup_steps": warmup, "micro_batches_per_step": accumulation,
            "tokens_per_step": tokens,
            "slots_per_step": slots, "step_s": step_s, "tokens_per_s": tokens / step_s if step_s else None,
            "slots_per_s": slots / step_s if step_s else None,
            "losses": [round(m["loss"], 4) for m in metrics], "finite": all(m["loss"] == m["loss"] for m in metrics),
            "loss_scale": metrics[-1].get("loss_scale"), "skipped_steps": sum(bool(m.get("skipped")) for m in metrics),
            "peak_memory_mb": round(peak_mb, 1), "compile": compiled, "attention_kernels": backends}


def part_training(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    gpu = _cuda() and not args.dry_run
    model = {"arch": "gpt", "preset": "small" if gpu else "tiny", "maxSeqLen": 512}
    seq, micro, steps = (512, 8, 20) if gpu else (32, 2, 3)
    res: dict[str, Any] = {"device": "cuda" if gpu else "cpu", "model": model, "seq_len": seq}
    for precision in ("bf16", "fp16"):
        try:
            res[precision] = _run_steps(_job(model, seq, micro, steps, precision, "none", False), steps, 1)
        except Exception as exc:  # noqa: BLE001 - record and go on with the other precision
            res[precision] = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:]}
    res["status"] = "ok" if all("error" not in res[p] and res[p]["finite"] for p in ("bf16", "fp16")) else "failed"
    return res


# ---- MFU ------------------------------------------------------------------------------------------------------

def measured_matmul_peak(n: int, repeat: int) -> dict[str, Any]:
    """Dense bf16 matmul FLOP/s of this GPU at n x n x n: what this card really does, reported beside the MFU
    (whose denominator is the datasheet peak), so a slow or throttled card is told apart from a slow model."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeat):
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / 10)
    return {"n": n, "seconds": best, "tflops": round(2 * n**3 / best / 1e12, 1), "timer": "CUDA events, best of "
            f"{repeat} x 10 products"}


def datasheet_peak() -> dict[str, Any]:
    """The MFU denominator: the dense bf16 datasheet figure of this GPU (`seqtrain.obs.peaks`), named."""
    from seqtrain.obs.peaks import device_peak_flops

    flops, source = device_peak_flops("bf16")
    if flops is None:
        return {"tflops": None, "source": source}
    return {"tflops": flops / 1e12, "source": f"datasheet dense bf16 peak of {source} (seqtrain.obs.peaks)"}


def mfu_of(run: dict[str, Any], flops_per_slot: float, datasheet_tflops: float | None,
           measured_tflops: float | None) -> dict[str, Any]:
    """MFU = model FLOPs per position x computed positions per second / datasheet peak (None where unknown)."""
    achieved = run["slots_per_s"] * flops_per_slot if run.get("slots_per_s") else None
    return {"model_flops_per_position": flops_per_slot,
            "model_tflops_per_s": float(f"{achieved / 1e12:.4g}") if achieved else None,
            "mfu": round(achieved / (datasheet_tflops * 1e12), 4) if achieved and datasheet_tflops else None,
            "mfu_vs_measured_matmul_peak": round(achieved / (measured_tflops * 1e12), 4)
            if achieved and measured_tflops else None}


def mfu_runs(gpu: bool, micro: int) -> list[dict[str, Any]]:
    """The MFU part's runs, most wanted first (a deadline cuts from the end). `key` names the run in mfu.json.

    On a GPU: micro-batch 4 accumulated to `ACCUM_TOKENS` per optimizer step (the headline), one optimizer step per
    `micro` sequences (the first lease's setting), micro-batch 8 accumulated likewise (`may_not_fit`: an
    out-of-memory there is a finding, not a failure), and the one-micro-batch step with full checkpointing. The dry
    run keeps the structure on a tiny model: two micro-batches per accumulated step."""
    if gpu:
        per_step = max(1, ACCUM_TOKENS // MFU_SEQ)  # sequences per optimizer step
        return [
            {"key": "accumulated_micro4", "micro": 4, "global": per_step, "ac": "none", "steps": 3, "warmup": 1},
            {"key": "activation_checkpointing_none", "micro": micro, "global": micro, "ac": "none", "steps": 10,
             "warmup": 3},
            {"key": "accumulated_micro8", "micro": 8, "global": per_step, "ac": "none", "steps": 3, "warmup": 1,
             "may_not_fit": True},
            {"key": "activation_checkpointing_full", "micro": micro, "global": micro, "ac": "full", "steps": 10,
             "warmup": 3},
            # the headline with q/k/v and gate/up as separate GEMMs: what optimization.fusedProjections gains
            {"key": "accumulated_micro4_unfused", "micro": 4, "global": per_step, "ac": "none", "steps": 3,
             "warmup": 1, "fused": False},
        ]
    return [
        {"key": "accumulated_micro4", "micro": 4, "global": 8, "ac": "none", "steps": 2, "warmup": 1},
        {"key": "activation_checkpointing_none", "micro": 2, "global": 2, "ac": "none", "steps": 3, "warmup": 1},
        {"key": "accumulated_micro8", "micro": 8, "global": 16, "ac": "none", "steps": 2, "warmup": 1,
         "may_not_fit": True},
        {"key": "activation_checkpointing_full", "micro": 2, "global": 2, "ac": "full", "steps": 3, "warmup": 1},
        {"key": "accumulated_micro4_unfused", "micro": 4, "global": 8, "ac": "none", "steps": 2, "warmup": 1,
         "fused": False},
    ]


def part_mfu(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import gc

    import torch

    from seqtrain.obs.flops import token_flops

    gpu = _cuda() and not args.dry_run
    if gpu:
        model, seq = MFU_MODEL, MFU_SEQ
        measured = measured_matmul_peak(8192, 5)
        peak = datasheet_peak()
    else:
        model, seq = {"arch": "gpt", "preset": "tiny", "maxSeqLen": 64}, 64
        measured, peak = {"status": NO_CUDA}, {"tflops": None, "source": NO_CUDA}
    runs = mfu_runs(gpu, args.micro_batch)
    res: dict[str, Any] = {
        "model": model, "seq_len": seq, "micro_batch": args.micro_batch if gpu else 2, "precision": "bf16",
        "compile_requested": gpu, "accumulation_tokens": ACCUM_TOKENS if gpu else None,
        "formula": "MFU = (6N + attention FLOPs per position) x slots (computed positions) / step time / peak",
        "peak": peak, "measured_matmul_peak": measured, "runs": [r["key"] for r in runs], "status": "partial"}
    for r in runs:
        try:
            # compiled blocks on the GPU (the default fast path); the dry run stays eager: inductor's CPU build
            # takes minutes on a small machine and is tested elsewhere
            steps = max(2, r["steps"] // 2) if args.quick and gpu else r["steps"]
            job = _job(model, seq, r["micro"], steps, "bf16", r["ac"], gpu, global_batch=r["global"],
                       fused=r.get("fused", True))
            # the attention kernel is the same at any accumulation: profiled on the one-micro-batch runs only
            run = _run_steps(job, steps, r["warmup"], attention=r["global"] == r["micro"])
            run.update({"micro_batch": r["micro"], "activation_checkpointing": r["ac"],
                        "fused_projections": r.get("fused", True)})
            run.update(mfu_of(run, token_flops(job.spec.model, seq).training, peak["tflops"],
                              measured.get("tflops")))
            res[r["key"]] = run
        except Exception as exc:  # noqa: BLE001 - an OOM in one run must not hide the others
            oom = isinstance(exc, torch.OutOfMemoryError)
            res[r["key"]] = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:],
                             "does_not_fit": oom}
        finally:
            torch._dynamo.reset()  # drop the compiled graphs (and the weights they hold) before the next run
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        _write_part(out, "mfu", res)  # the earlier runs' figures survive a kill during a later one
    failed = [r["key"] for r in runs if "error" in res[r["key"]]
              and not (r.get("may_not_fit") and res[r["key"]]["does_not_fit"])]
    res["status"] = "ok" if not failed else f"failed: {', '.join(failed)}"
    if not gpu:
        res["note"] = "tiny model on the CPU: exercises the harness; MFU needs CUDA"
    return res


# ---- profile: one optimizer step by kernel class ------------------------------------------------------------------

# (class, name fragments), first match wins: attention before matmul (flash kernels hold gemm-like names), the loss
# before pointwise. Names are CUDA kernel names on a GPU (cuBLAS nvjet/sm90 gemm, cuDNN/flash SDPA, inductor's
# triton_poi/red/per, fused Adam's multi_tensor_apply) and aten op names on the CPU.
KERNEL_CLASSES: list[tuple[str, tuple[str, ...]]] = [
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product", "cudnn_generated", "flex")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "logsumexp")),
    ("optimizer_and_clip", ("adam", "sgd", "multi_tensor", "foreach", "lpnorm", "clip_grad", "optimizer")),
    ("matmul", ("gemm", "nvjet", "cutlass", "cublas", "xmma", "wgmma", "splitk", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::_addmm", "aten::matmul")),
    ("memory_copies", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy")),
]
KERNEL_CLASS_NAMES = [c for c, _ in KERNEL_CLASSES] + ["pointwise"]


def kernel_class(name: str) -> str:
    """The class of one kernel (or CPU op) by its name; whatever is none of the named ones is `pointwise`
    (elementwise, norms, reductions, inductor's fused kernels)."""
    low = name.lower()
    for cls, fragments in KERNEL_CLASSES:
        if any(f in low for f in fragments):
            return cls
    return "pointwise"


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of (start_us, end_us) intervals: overlapping kernels count once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def breakdown(kernels: list[tuple[str, float, float]], wall_ms: float, device: bool) -> dict[str, Any]:
    """Milliseconds by kernel class from (name, start_us, duration_us); with `device` (GPU kernels) also the
    device's busy and idle time between its first kernel's start and its last kernel's end."""
    by_class = dict.fromkeys(KERNEL_CLASS_NAMES, 0.0)
    top: dict[str, float] = {}
    for name, _, dur in kernels:
        by_class[kernel_class(name)] += dur / 1e3
        top[name] = top.get(name, 0.0) + dur / 1e3
    res: dict[str, Any] = {"ms_by_class": {k: round(v, 3) for k, v in by_class.items()},
                           "step_wall_ms": round(wall_ms, 3), "kernels": len(kernels),
                           "top_kernels_ms": {k[:160]: round(v, 3) for k, v in
                                              sorted(top.items(), key=lambda kv: -kv[1])[:15]}}
    if device and kernels:
        span = (max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)) / 1e3
        busy = busy_ms([(s, s + d) for _, s, d in kernels])
        res.update({"gpu_span_ms": round(span, 3), "gpu_busy_ms": round(busy, 3),
                    "gpu_idle_ms": round(span - busy, 3), "gpu_idle_fraction": round(1 - busy / span, 4)
                    if span else None})
    else:
        res.update({"gpu_span_ms": None, "gpu_busy_ms": None, "gpu_idle_ms": None, "gpu_idle_fraction": None})
    return res


def profiled_kernels(prof: Any, device: bool) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of the profile's GPU kernels (`device`), else of its CPU ops by their self
    time (a parent op's time without its children's: nothing counted twice)."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if getattr(e, "is_user_annotation", False) or e.name.startswith("ProfilerStep"):
            continue  # record_function ranges (also mirrored on the GPU timeline) are not kernels
        if device and e.device_type == DeviceType.CUDA:
            out.append((e.name, float(e.time_range.start), float(e.time_range.elapsed_us())))
        elif not device and e.device_type == DeviceType.CPU:
            # an unfused optimizer's ops (sqrt, mul_, addcdiv_) are pointwise by name: class them by their caller
            name = f"optimizer.step/{e.name}" if _under_optimizer_step(e) else e.name
            out.append((name, float(e.time_range.start), float(e.self_cpu_time_total)))
    return out


def _under_optimizer_step(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("Optimizer.step"):
            return True
        parent = parent.cpu_parent
    return False


def write_trace(prof: Any, out: Path, cap: int = TRACE_CAP_BYTES) -> dict[str, Any]:
    """The Chrome trace, gzip-compressed, as out/PROFILE_TRACE when it is under `cap` bytes; else removed."""
    import gzip
    import shutil

    target = out / PROFILE_TRACE
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(target, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        raw_bytes = raw.stat().st_size
    size = target.stat().st_size
    if size > cap:
        target.unlink()
        return {"trace": None, "trace_bytes": size, "trace_note": f"{size} bytes gzip-compressed, over the cap of "
                f"{cap}: not kept", "trace_raw_bytes": raw_bytes}
    return {"trace": target.name, "trace_bytes": size, "trace_raw_bytes": raw_bytes}


def part_profile(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One optimizer step of the MFU model (micro-batch 4, `PROFILE_ACCUM` micro-batches) under torch.profiler,
    after two warm-up steps (compile, autotune)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = _cuda() and not args.dry_run
    if gpu:
        model, seq, micro, accum = MFU_MODEL, MFU_SEQ, 4, PROFILE_ACCUM
    else:
        model, seq, micro, accum = {"arch": "gpt", "preset": "tiny", "maxSeqLen": 64}, 64, 2, 2
    job = _job(model, seq, micro, 3, "bf16", "none", gpu, global_batch=micro * accum)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    with _trainer(job) as trainer:
        for _ in range(2):
            trainer.train_step()
        _sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            trainer.train_step()
            _sync()
            wall_ms = (time.perf_counter() - t0) * 1e3
    res: dict[str, Any] = {
        "device": "cuda" if gpu else "cpu", "model": model, "seq_len": seq, "micro_batch": micro,
        "micro_batches_per_step": accum, "precision": "bf16", "compile_requested": gpu,
        "activities": [a.name for a in activities],
        "what": "GPU kernel time by class and the GPU's idle time inside the step" if gpu else
        "CPU op self time by class (no GPU: idle time does not apply)",
        **breakdown(profiled_kernels(prof, gpu), wall_ms, gpu), **write_trace(prof, out)}
    res["status"] = "ok" if res["kernels"] else "failed: the profiler recorded no kernels"
    return res


# ---- driver ---------------------------------------------------------------------------------------------------

RUNNERS = {"tests": part_tests, "kernels": part_kernels, "training": part_training, "mfu": part_mfu,
           "profile": part_profile}
SALVAGE = {"kernels": salvage_kernels}


# Beyond torch (and triton for the kernels): what seqtrain itself imports on this path. Everything else
# (deepspeed, tensorboard, prometheus_client, tokenizers, matplotlib, psutil, rich, kopf, kubernetes) stays
# unimported.
REQUIRED = {"torch": "torch", "numpy": "numpy", "pydantic": "pydantic>=2.6", "yaml": "pyyaml"}


def missing_modules() -> list[str]:
    return [pip for mod, pip in REQUIRED.items() if importlib.util.find_spec(mod) is None]


def _write_part(out: Path, part: str, res: dict[str, Any]) -> None:
    tmp = out / f".{part}.json.tmp"
    tmp.write_text(json.dumps(res, indent=2, default=str) + "\n")
    tmp.replace(out / f"{part}.json")  # atomic: a reader (or a kill) never sees half a file


def _child(args: argparse.Namespace) -> int:
    """One part, in this process: run it and write its JSON."""
    t0 = time.perf_counter()
    try:
        res = RUNNERS[args.run_part](args, args.out)
    except Exception as exc:  # noqa: BLE001 - the JSON says what broke
        res = {"status": f"error: {type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-3000:]}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    _write_part(args.out, args.run_part, res)
    return 0


def _child_argv(args: argparse.Namespace, part: str) -> list[str]:
    argv = ["--out", str(args.out), "--run-part", part, "--micro-batch", str(args.micro_batch)]
    return argv + (["--dry-run"] if args.dry_run else []) + (["--quick"] if args.quick else [])


def _limit_text(limit: float) -> str:
    return "no deadline" if limit == float("inf") else f"deadline {limit:.0f}s"


def _run_part(args: argparse.Namespace, part: str, limit: float, log: Any) -> dict[str, Any]:
    """Run one part in a child process (its own session, so a kill takes its compile workers too) for at most
    `limit` seconds; returns its JSON, or what it had written and why it did not finish."""
    (args.out / f"{part}.json").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "seqtrain.benchmarks.gpu", *_child_argv(args, part)]
    log.write(f"==== {part} ({_limit_text(limit)}): {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=None if limit == float("inf") else limit)
        late = None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code, late = proc.returncode, f"error: killed at its deadline of {limit:g}s"
    path = args.out / f"{part}.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if late:
        res = {**res, **(SALVAGE[part](args.out) if part in SALVAGE and "summary" not in res else {}),
               "status": late, "status_before_kill": res.get("status")}
    elif not res:
        res = {"status": f"error: the {part} process exited {code} without writing {part}.json (see bench.log)"}
    return res


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    missing = missing_modules()
    if missing:
        print(f"seqtrain bench gpu: missing Python packages: {', '.join(missing)}. Install them "
              f"(pip install {' '.join(repr(m) for m in missing)}), or on a machine without network carry the "
              "wheels: `pip download -d wheels ...` here, `pip install --no-index wheels/*.whl` there "
              "(scripts/device-wheels.sh does it for the lent GPU machine).", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        args.dry_run = True
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before seqtrain.kernels.ops is imported
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()
    if args.run_part:
        return _child(args)
    # One compile cache for all parts (each a process of its own): what the MFU part compiles and the kernels
    # part autotunes, the later parts find warm. scripts/device-bench.sh sets both; this is the fallback.
    cache = Path(tempfile.gettempdir()) / "seqtrain-bench-gpu-cache"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "trainer"), str(REPO / "operator")] + [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p])
    # The deadlines are sized for an H100; the dry run (a CPU, maybe a loaded one) keeps only those given.
    deadlines = {**({} if args.dry_run else DEADLINES), **dict(args.deadline)}
    if args.budget_s is None:
        args.budget_s = float("inf") if args.dry_run else float(sum(DEADLINES[p] for p in args.parts.split(",")))
    summary: dict[str, Any] = {
        "benchmark": "gpu", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "seqtrain bench gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else
        f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "dry_run": args.dry_run, "python": platform.python_version(), "torch": torch.__version__,
        "budget_s": None if args.budget_s == float("inf") else args.budget_s, "deadlines_s": deadlines, "parts": {},
    }
    t_all = time.perf_counter()
    with open(args.out / "bench.log", "a", encoding="utf-8") as log:
        for part in args.parts.split(","):
            left = args.budget_s - (time.perf_counter() - t_all)
            if left < 5:
                summary["parts"][part] = {"status": f"skipped: over the {args.budget_s:.0f}s budget",
                                          "seconds": 0.0}
                continue
            limit = min(deadlines.get(part, float("inf")), left)
            t0 = time.perf_counter()
            print(f"seqtrain bench gpu: {part} ({_limit_text(limit)}) ...", file=sys.stderr, flush=True)
            res = _run_part(args, part, limit, log)
            res["wall_s"] = round(time.perf_counter() - t0, 1)  # process start and imports included
            _write_part(args.out, part, res)
            summary["parts"][part] = {"status": res.get("status"), "seconds": res["wall_s"], "file": f"{part}.json"}
            print(f"seqtrain bench gpu: {part}: {res.get('status')} ({res['wall_s']}s)", file=sys.stderr, flush=True)
    summary["seconds"] = round(time.perf_counter() - t_all, 1)
    summary["headline"] = _headline(args.out)
    _write_part(args.out, "summary", summary)
    print(json.dumps(summary, indent=2))
    bad = [p for p, r in summary["parts"].items() if not str(r["status"]).startswith(("ok", "skipped"))]
    return 1 if bad else 0


def _headline(out: Path) -> dict[str, Any] | None:
    """The MFU figures (and the profile's breakdown, when it ran), lifted into summary.json."""
    path = out / "mfu.json"
    if not path.exists():
        return None
    mfu = json.loads(path.read_text())
    runs = {ac: mfu.get(f"activation_checkpointing_{ac}", {}) for ac in ("none", "full")}
    acc = {m: mfu.get(f"accumulated_micro{m}", {}) for m in (4, 8)}
    head = {"peak": mfu.get("peak"), "measured_matmul_peak_tflops": (mfu.get("measured_matmul_peak") or {}).get(
        "tflops"), **{f"mfu_ac_{ac}": r.get("mfu") for ac, r in runs.items()},
        **{f"model_tflops_per_s_ac_{ac}": r.get("model_tflops_per_s") for ac, r in runs.items()},
        **{f"peak_memory_mb_ac_{ac}": r.get("peak_memory_mb") for ac, r in runs.items()},
        **{f"mfu_accumulated_micro{m}": r.get("mfu") for m, r in acc.items()},
        **{f"tokens_per_step_accumulated_micro{m}": r.get("tokens_per_step") for m, r in acc.items()},
        **{f"peak_memory_mb_accumulated_micro{m}": r.get("peak_memory_mb") for m, r in acc.items()},
        "mfu_accumulated_micro4_unfused": mfu.get("accumulated_micro4_unfused", {}).get("mfu")}
    prof = out / "profile.json"
    if prof.exists():
        p = json.loads(prof.read_text())
        head["profile_ms_by_class"] = p.get("ms_by_class")
        head["profile_gpu_idle_ms"] = p.get("gpu_idle_ms")
    return head


if __name__ == "__main__":
    sys.exit(main())
