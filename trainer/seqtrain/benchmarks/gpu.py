"""`seqtrain bench gpu --out DIR`: everything a lent GPU must show, in one command, as JSON in DIR.

Parts (each writes DIR/<part>.json and a line in DIR/summary.json; `--parts` picks a subset):
- tests:    `pytest -m gpu` (the CUDA tests), pass/fail/skip counts from its JUnit XML.
- kernels:  `seqtrain bench kernels` at the preset shapes: Triton kernels vs the PyTorch reference vs
            torch.compile of the reference (time, peak memory, accuracy vs float64).
- training: a few real training steps (the Trainer: meta build, engine, autocast) in bf16 and in fp16
            (dynamic loss scaling): loss first/last, finite, step time, loss scale.
- mfu:      a GPT of about 1.3B parameters (the `1b` preset with 28 layers) in bf16 at sequence length 2048
            on one GPU, with torch.compile: tokens/s, MFU against the *measured* dense bf16 matmul peak of
            this GPU (and against the datasheet), peak memory; without and with full activation
            checkpointing.

Budget: under 9 minutes on one H100 (the step counts below are sized for it; `--quick` halves them). On a
machine without CUDA every part still runs as far as it can on tiny shapes (`--dry-run`, implied there):
the kernels on Triton's interpreter when triton imports, the training steps and the MFU harness on tiny
models on the CPU, and what needs a GPU is recorded as "skipped: no CUDA". Needs only torch (and triton for
the kernels) beyond seqtrain itself; pytest only for the tests part.

    seqtrain bench gpu --out bench-gpu/                 # on the GPU machine
    seqtrain bench gpu --out /tmp/b --dry-run           # the CPU path: exercises the code, no figures
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

PARTS = ["tests", "kernels", "training", "mfu"]
NO_CUDA = "skipped: no CUDA"
REPO = Path(__file__).resolve().parents[3]  # the checkout: trainer/seqtrain/benchmarks/gpu.py

# The MFU model: GPT `1b` preset (dim 2048, GQA 16/8 heads, SwiGLU 5632) deepened to 28 layers = ~1.3B.
MFU_MODEL = {"arch": "gpt", "preset": "1b", "layers": 28, "vocabSize": 32768, "maxSeqLen": 2048}
MFU_SEQ = 2048


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="seqtrain bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON files (created)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of: {','.join(PARTS)}")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes and few steps: exercise every code path (implied without CUDA)")
    p.add_argument("--quick", action="store_true", help="half the timed steps (GPU)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step in the MFU part (default 4)")
    p.add_argument("--tests-timeout", type=int, default=180, help="seconds for `pytest -m gpu` (default 180)")
    p.add_argument("--budget-s", type=float, default=510.0,
                   help="a part that would start after this many seconds is recorded as skipped (default 510: the "
                        "9-minute limit of a lent H100 session, less a margin)")
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

def part_tests(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    if not _cuda():
        return {"status": NO_CUDA, "command": "pytest -m gpu"}
    if not (REPO / "tests").is_dir():
        return {"status": f"skipped: no tests/ folder under {REPO}"}
    xml = out / "pytest-gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "tests"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.tests_timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"error: pytest -m gpu ran past {args.tests_timeout}s", "command": " ".join(cmd[2:])}
    res: dict[str, Any] = {"command": " ".join(cmd[2:]), "exit_code": proc.returncode,
                           "seconds": round(time.perf_counter() - t0, 1), "output_tail": proc.stdout[-3000:]}
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

def part_kernels(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from seqtrain.benchmarks import kernels

    target = out / "kernels-detail.json"
    if _cuda() and not args.dry_run:
        argv = ["--device", "cuda", "--repeat", "5" if args.quick else "10", "--out", str(target)]
    else:
        try:
            import triton  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means no interpreter either
            return {"status": f"skipped: triton does not import ({type(exc).__name__})"}
        argv = ["--device", "cpu", "--ops", "rms_norm,attention", "--repeat", "1", "--no-accuracy",
                "--out", str(target)]
    code = kernels.main(argv)
    detail = json.loads(target.read_text()) if target.exists() else {}
    rows = [{"op": r["op"], "shape": r["shape"], "kernel_ms": r["kernel"].get("ms"),
             "reference_ms": r["reference"].get("ms"), "compiled_ms": (r.get("compiled") or {}).get("ms"),
             "speedup_vs_reference": r.get("speedup"),
             "speedup_vs_compiled": _ratio((r.get("compiled") or {}).get("ms"), r["kernel"].get("ms"))}
            for r in detail.get("results", [])]
    return {"status": "ok" if code == 0 else f"failed (exit {code})", "command": "seqtrain bench kernels " +
            " ".join(argv), "summary": rows, "detail_file": target.name,
            "note": None if _cuda() else "Triton interpreter on the CPU: times are not speeds"}


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


def _run_steps(job: Any, steps: int, warmup: int) -> dict[str, Any]:
    """Run `steps` optimizer steps of `job` in this process; time the ones after `warmup`."""
    import torch

    from seqtrain.models import count_parameters
    from seqtrain.runtime.dist import DistContext
    from seqtrain.spec import RuntimeConfig
    from seqtrain.train.loop import Trainer

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
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
        params = count_parameters(trainer.model)
        del trainer
    tokens = metrics[-1]["tokens"]
    step_s = statistics.median(times) if times else None
    peak_mb = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else metrics[-1]["mem_peak_mb"]
    return {"params": params, "steps": steps, "warmup_steps": warmup, "tokens_per_step": tokens,
            "step_s": step_s, "tokens_per_s": tokens / step_s if step_s else None,
            "losses": [round(m["loss"], 4) for m in metrics], "finite": all(m["loss"] == m["loss"] for m in metrics),
            "loss_scale": metrics[-1].get("loss_scale"), "skipped_steps": sum(bool(m.get("skipped")) for m in metrics),
            "peak_memory_mb": round(peak_mb, 1)}


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
    """Dense bf16 matmul FLOP/s of this GPU at n x n x n (the MFU denominator: what this card really does)."""
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
    return {"n": n, "seconds": best, "tflops": round(2 * n**3 / best / 1e12, 1)}


def part_mfu(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from seqtrain.obs.flops import token_flops
    from seqtrain.obs.peaks import device_peak_flops

    gpu = _cuda() and not args.dry_run
    if gpu:
        model, seq, micro = MFU_MODEL, MFU_SEQ, args.micro_batch
        steps, warmup = (6, 2) if args.quick else (10, 3)
        peak = measured_matmul_peak(8192, 5)
        datasheet, source = device_peak_flops("bf16")
    else:
        model, seq, micro, steps, warmup = {"arch": "gpt", "preset": "tiny", "maxSeqLen": 64}, 64, 2, 3, 1
        peak, datasheet, source = {"status": NO_CUDA}, None, "no CUDA"
    res: dict[str, Any] = {"model": model, "seq_len": seq, "micro_batch": micro, "precision": "bf16",
                           "compile": gpu, "measured_peak": peak,
                           "datasheet_peak_tflops": datasheet / 1e12 if datasheet else None, "peak_source": source}
    for ac in ("none", "full"):
        key = f"activation_checkpointing_{ac}"
        try:
            # compiled blocks on the GPU (the default fast path); the dry run stays eager: inductor's CPU build
            # takes minutes on a small machine and is tested elsewhere
            job = _job(model, seq, micro, steps, "bf16", ac, gpu)
            run = _run_steps(job, steps, warmup)
            flops = token_flops(job.spec.model, seq).training
            achieved = run["tokens_per_s"] * flops if run["tokens_per_s"] else None
            run["model_tflops_per_s"] = round(achieved / 1e12, 2) if achieved else None
            if gpu and achieved:
                run["mfu_vs_measured_peak"] = round(achieved / (peak["tflops"] * 1e12), 4)
                run["mfu_vs_datasheet"] = round(achieved / datasheet, 4) if datasheet else None
            else:
                run["mfu_vs_measured_peak"] = NO_CUDA
            res[key] = run
        except Exception as exc:  # noqa: BLE001 - an OOM with checkpointing off must not hide the other run
            res[key] = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:]}
        finally:
            import gc

            import torch

            torch._dynamo.reset()  # drop the compiled graphs (and the weights they hold) before the next run
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
    res["status"] = "ok" if all("error" not in res[f"activation_checkpointing_{a}"] for a in ("none", "full")) \
        else "failed"
    if not gpu:
        res["note"] = "tiny model on the CPU: exercises the harness; MFU needs CUDA"
    return res


# ---- driver ---------------------------------------------------------------------------------------------------

RUNNERS = {"tests": part_tests, "kernels": part_kernels, "training": part_training, "mfu": part_mfu}


# Beyond torch (and triton for the kernels): what seqtrain itself imports on this path. Everything else
# (deepspeed, tensorboard, prometheus_client, tokenizers, matplotlib, psutil, rich) stays unimported.
REQUIRED = {"torch": "torch", "numpy": "numpy", "pydantic": "pydantic>=2.6", "yaml": "pyyaml"}


def missing_modules() -> list[str]:
    import importlib.util

    return [pip for mod, pip in REQUIRED.items() if importlib.util.find_spec(mod) is None]


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    missing = missing_modules()
    if missing:
        print(f"seqtrain bench gpu: missing Python packages: {', '.join(missing)}. Install them "
              f"(pip install {' '.join(repr(m) for m in missing)}), or on a machine without network carry the "
              "wheels: `pip download -d wheels ...` here, `pip install --no-index wheels/*.whl` there.",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        args.dry_run = True
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before seqtrain.kernels.ops is imported
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "benchmark": "gpu", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "seqtrain bench gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else
        f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "dry_run": args.dry_run, "torch": torch.__version__, "parts": {},
    }
    t_all = time.perf_counter()
    for part in args.parts.split(","):
        if time.perf_counter() - t_all > args.budget_s:
            summary["parts"][part] = {"status": f"skipped: over the {args.budget_s:.0f}s budget", "seconds": 0.0}
            continue
        t0 = time.perf_counter()
        print(f"seqtrain bench gpu: {part} ...", file=sys.stderr, flush=True)
        try:
            res = RUNNERS[part](args, args.out)
        except Exception as exc:  # noqa: BLE001 - one broken part must not lose the others' figures
            res = {"status": f"error: {type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        (args.out / f"{part}.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
        summary["parts"][part] = {"status": res.get("status"), "seconds": res["seconds"], "file": f"{part}.json"}
        print(f"seqtrain bench gpu: {part}: {res.get('status')} ({res['seconds']}s)", file=sys.stderr, flush=True)
    summary["seconds"] = round(time.perf_counter() - t_all, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    bad = [p for p, r in summary["parts"].items() if not str(r["status"]).startswith(("ok", "skipped"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
