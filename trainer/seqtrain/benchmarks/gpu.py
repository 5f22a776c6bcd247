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
            kernel ran (aten op names under the profiler). Without and with full activation checkpointing.
- kernels:  `seqtrain bench kernels` at realistic shapes: each Triton kernel against what the trainer runs
            without it (SDPA with is_causal and GQA, flex_attention for packed documents, torch.compile of the
            reference), timed with `triton.testing.do_bench`.
- training: a few real training steps (the Trainer: meta build, engine, autocast) in bf16 and in fp16
            (dynamic loss scaling): loss first/last, finite, step time, loss scale.
- tests:    `pytest -m gpu` on exactly the GPU test files (`GPU_TEST_FILES`; none imports kopf or kubernetes);
            pass/fail/skip counts from its JUnit XML. Without CUDA: `pytest --collect-only` of those files, and
            the count it collected.

Budget: the deadlines add up to 520 s (`DEADLINES`), inside the 10 minutes of a lent H100 command with a
margin; a part past its deadline is killed and recorded as such with what it had written. All parts share one
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
from pathlib import Path
from typing import Any

PARTS = ["mfu", "kernels", "training", "tests"]  # MFU first: the headline figure never waits on another part
# Seconds per part on one H100 (their sum, 520 s, inside the 10-minute command with the install and start-up).
# Sized from the first H100 lease (2026-11-26): mfu took 51 s, training 17 s, kernels 126-150+ s (cold Triton
# cache: over 150), tests over 170 s (unknown how far over: that run was silent until killed).
DEADLINES = {"mfu": 110, "kernels": 170, "training": 40, "tests": 200}
GPU_TEST_TIMEOUT_S = 120  # per GPU test: one test's autotuning may compile dozens of kernels
NO_CUDA = "skipped: no CUDA"
REPO = Path(__file__).resolve().parents[3]  # the checkout: trainer/seqtrain/benchmarks/gpu.py
# The test files that hold the `gpu`-marked tests (tests/unit/test_bench_gpu.py checks the list is complete).
GPU_TEST_FILES = ["tests/unit/kernels/test_kernel_gpu.py", "tests/unit/test_precision.py",
                  "tests/unit/test_cuda_gpu.py"]

# The MFU model: GPT `1b` preset (dim 2048, GQA 16/8 heads, SwiGLU 5632) deepened to 28 layers = ~1.3B.
MFU_MODEL = {"arch": "gpt", "preset": "1b", "layers": 28, "vocabSize": 32768, "maxSeqLen": 2048}
MFU_SEQ = 2048


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
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of: {','.join(PARTS)}")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes and few steps: exercise every code path (implied without CUDA)")
    p.add_argument("--quick", action="store_true", help="half the timed steps (GPU)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step in the MFU part (default 4)")
    p.add_argument("--deadline", type=_deadline_arg, action="append", default=[], metavar="PART=SECONDS",
                   help="override one part's deadline (repeatable); defaults on a GPU: " +
                        ", ".join(f"{k}={v}" for k, v in DEADLINES.items()) + " (the dry run has none)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole run: a part gets at most what is left of it, and one that would "
                        "start with under 5 s left is recorded as skipped (default: the sum of the deadlines on "
                        "a GPU; none in the dry run, whose speed says nothing about a GPU's)")
    p.add_argument("--run-part", choices=PARTS, help=argparse.SUPPRESS)  # the child process of one part
    args = p.parse_args(argv)
    unknown = [x for x in args.parts.split(",") if x not in PARTS]
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
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
    if importlib.util.find_spec("pytest_timeout") is not None:
        extra.append(f"--timeout={GPU_TEST_TIMEOUT_S}")
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

def _job(model: dict[str, Any], seq: int, micro: int, steps: int, precision: str, ac: str, compile_: bool) -> Any:
    from seqtrain.spec import parse_job, resolve

    doc = {
        "apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "bench-gpu"},
        "spec": {
            "model": model,
            # copy examples of 2L + 3 tokens fill each sequence (no padding: tokens/s counts real tokens)
            "data": {"source": "synthetic", "seqLen": seq, "synthetic": {"length": (seq - 3) // 2}},
            "training": {"steps": steps, "globalBatchSize": micro, "microBatchSize": micro, "seed": 0,
                         "logEvery": 10**6, "optimizer": {"lr": 3e-4}, "schedule": {"name": "constant"}},
            "optimization": {"precision": precision, "compile": compile_,
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


def _run_steps(job: Any, steps: int, warmup: int) -> dict[str, Any]:
    """Run `steps` optimizer steps of `job` in this process; time the ones after `warmup` (which compile and
    autotune), then one more step under the profiler to see which attention kernel ran."""
    import contextlib

    import torch

    from seqtrain.models import count_parameters
    from seqtrain.models.compile import compile_report
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
        metrics, times = [], []
        for i in range(steps):
            _sync()
            t0 = time.perf_counter()
            m = trainer.train_step()
            _sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            metrics.append(m)
        peak_mb = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else metrics[-1]["mem_peak_mb"]
        compiled = compile_report(trainer.model) if trainer.spec.optimization.compile else None
        backends = attention_backends(trainer.train_step)
        params = count_parameters(trainer.model)
        del trainer
    step_s = statistics.median(times) if times else None
    tokens, slots = metrics[-1]["tokens"], metrics[-1]["slots"]
    return {"params": params, "steps": steps, "warmup_steps": warmup, "tokens_per_step": tokens,
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


def part_mfu(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import gc

    import torch

    from seqtrain.obs.flops import token_flops

    gpu = _cuda() and not args.dry_run
    if gpu:
        model, seq, micro = MFU_MODEL, MFU_SEQ, args.micro_batch
        steps, warmup = (6, 2) if args.quick else (10, 3)
        measured = measured_matmul_peak(8192, 5)
        peak = datasheet_peak()
    else:
        model, seq, micro, steps, warmup = {"arch": "gpt", "preset": "tiny", "maxSeqLen": 64}, 64, 2, 3, 1
        measured, peak = {"status": NO_CUDA}, {"tflops": None, "source": NO_CUDA}
    res: dict[str, Any] = {
        "model": model, "seq_len": seq, "micro_batch": micro, "precision": "bf16", "compile_requested": gpu,
        "formula": "MFU = (6N + attention FLOPs per position) x slots (computed positions) / step time / peak",
        "peak": peak, "measured_matmul_peak": measured, "status": "partial"}
    for ac in ("none", "full"):
        key = f"activation_checkpointing_{ac}"
        try:
            # compiled blocks on the GPU (the default fast path); the dry run stays eager: inductor's CPU build
            # takes minutes on a small machine and is tested elsewhere
            job = _job(model, seq, micro, steps, "bf16", ac, gpu)
            run = _run_steps(job, steps, warmup)
            run.update(mfu_of(run, token_flops(job.spec.model, seq).training, peak["tflops"],
                              measured.get("tflops")))
            res[key] = run
        except Exception as exc:  # noqa: BLE001 - an OOM with checkpointing off must not hide the other run
            res[key] = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:]}
        finally:
            torch._dynamo.reset()  # drop the compiled graphs (and the weights they hold) before the next run
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        _write_part(out, "mfu", res)  # the first run's figures survive a kill during the second
    res["status"] = "ok" if all("error" not in res[f"activation_checkpointing_{a}"] for a in ("none", "full")) \
        else "failed"
    if not gpu:
        res["note"] = "tiny model on the CPU: exercises the harness; MFU needs CUDA"
    return res


# ---- driver ---------------------------------------------------------------------------------------------------

RUNNERS = {"tests": part_tests, "kernels": part_kernels, "training": part_training, "mfu": part_mfu}
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
        args.budget_s = float("inf") if args.dry_run else float(sum(DEADLINES.values()))
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
    """The MFU figures, lifted into summary.json."""
    path = out / "mfu.json"
    if not path.exists():
        return None
    mfu = json.loads(path.read_text())
    runs = {ac: mfu.get(f"activation_checkpointing_{ac}", {}) for ac in ("none", "full")}
    return {"peak": mfu.get("peak"), "measured_matmul_peak_tflops": (mfu.get("measured_matmul_peak") or {}).get(
        "tflops"), **{f"mfu_ac_{ac}": r.get("mfu") for ac, r in runs.items()},
        **{f"model_tflops_per_s_ac_{ac}": r.get("model_tflops_per_s") for ac, r in runs.items()},
        **{f"peak_memory_mb_ac_{ac}": r.get("peak_memory_mb") for ac, r in runs.items()}}


if __name__ == "__main__":
    sys.exit(main())
