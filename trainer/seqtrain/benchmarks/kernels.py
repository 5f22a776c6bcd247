"""`seqtrain bench kernels`: time and peak memory of each kernel against the PyTorch reference.

For every op and a few shapes it runs forward + backward of: the Triton kernel, the PyTorch reference,
(where it compiles) `torch.compile` of the reference, and the baseline: what the trainer runs when the
kernels are off (`trainer_baseline`: for attention the model's own SDPA call with `is_causal` and
grouped-query heads, or flex_attention with a block mask for packed documents on CUDA; for the other
ops torch.compile of the reference, as compiled blocks fuse them). It reports the median step time
(`triton.testing.do_bench` on CUDA: CUDA events, L2 flushed between runs; wall clock on the CPU), the
peak memory above the inputs (CUDA allocator on GPU, live torch tensors on CPU: see
`seqtrain.kernels.memory`), the ratios kernel/reference and `speedup_vs_baseline`, the one that
says whether the kernel should replace what the trainer runs. The reference builds an explicit
mask for attention (no FLASH kernel), so `speedup` alone flatters the attention kernel. It also records the accuracy of kernel
and reference against float64 on small shapes. On CUDA this measures the real speedups. On the CPU
the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set here): the times are then those
of an emulator and say nothing about speed, but the memory columns still reflect each algorithm's
buffers, and running it keeps the benchmark from rotting.

    seqtrain bench kernels --out kernels.json                     # auto device, its default shapes
    seqtrain bench kernels --device cpu --ops attention,linear_scan --repeat 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OPS = ["rms_norm", "layer_norm", "swiglu", "rope", "cross_entropy", "linear_cross_entropy", "attention",
       "linear_scan"]

# Shapes per op: "small" runs in Triton's CPU interpreter within seconds; "realistic" are GPU
# training sizes (a 1-8B-parameter transformer layer, 2K-8K tokens per micro-batch).
SHAPES: dict[str, dict[str, list[dict[str, Any]]]] = {
    "small": {
        "rms_norm": [dict(shape=(4, 64, 256))],
        "layer_norm": [dict(shape=(4, 64, 256))],
        "swiglu": [dict(shape=(4, 64, 512))],
        "rope": [dict(batch=1, heads=4, seq=64, dim=32)],
        "cross_entropy": [dict(rows=(128,), vocab=1000)],
        "linear_cross_entropy": [dict(rows=(256,), hidden=64, vocab=2000)],
        "attention": [dict(batch=1, heads=2, kv_heads=2, seq=128, dim=32, causal=True),
                      dict(batch=1, heads=2, kv_heads=1, seq=128, dim=32, causal=True, docs="packed")],
        "linear_scan": [dict(batch=2, seq=128, dim=16)],
    },
    "realistic": {
        "rms_norm": [dict(shape=(4, 2048, 4096))],
        "layer_norm": [dict(shape=(4, 2048, 4096))],
        "swiglu": [dict(shape=(4, 2048, 11008))],
        "rope": [dict(batch=4, heads=32, seq=2048, dim=128)],
        "cross_entropy": [dict(rows=(8192,), vocab=32000)],
        "linear_cross_entropy": [dict(rows=(8192,), hidden=4096, vocab=32000),
                                 dict(rows=(4096,), hidden=2048, vocab=128256)],
        "attention": [dict(batch=4, heads=16, kv_heads=16, seq=2048, dim=64, causal=True),
                      dict(batch=2, heads=32, kv_heads=8, seq=4096, dim=128, causal=True),
                      dict(batch=2, heads=32, kv_heads=8, seq=4096, dim=128, causal=True, docs="packed")],
        "linear_scan": [dict(batch=8, seq=2048, dim=1024), dict(batch=4, seq=8192, dim=512)],
    },
}
ACCURACY_SHAPES = {op: cases[0] for op, cases in SHAPES["small"].items()}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="seqtrain bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda when available (auto), else cpu through Triton's interpreter")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of: {','.join(OPS)}")
    p.add_argument("--shapes", choices=["auto", "small", "realistic"], default="auto",
                   help="shape preset (auto: realistic on cuda, small on cpu)")
    p.add_argument("--shape", type=_shape_arg, action="append", default=[], metavar="JSON",
                   help='replace the preset shapes with this one (repeatable), e.g. '
                        '\'{"rows": [4096], "hidden": 512, "vocab": 32000}\' for linear_cross_entropy; '
                        'keys as in seqtrain.kernels.accuracy (use with a single --ops)')
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="input dtype (auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="also time torch.compile(reference) (auto: on for cuda, off for cpu)")
    p.add_argument("--repeat", type=int, default=0, help="timed iterations (default: 20 on cuda, 2 on cpu)")
    p.add_argument("--warmup", type=int, default=-1, help="untimed iterations first (default: 3 on cuda, 0 on cpu)")
    p.add_argument("--no-accuracy", action="store_true", help="skip the float64 accuracy check")
    p.add_argument("--out", type=Path, help="write the results as JSON to this file")
    args = p.parse_args(argv)
    unknown = [o for o in args.ops.split(",") if o not in OPS]
    if unknown:
        p.error(f"--ops: unknown op(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")
    if args.shape and "," in args.ops:
        p.error("--shape: give exactly one op with --ops (shape keys differ between ops)")
    return args


def _shape_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); example: '{{\"shape\": [8, 1024]}}'") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of shape keywords")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _step_fn(fn: Callable[..., Any], args: list[Any], grad_pos: tuple[int, ...], kwargs: dict[str, Any]):
    """A forward + backward closure over fixed inputs; clears the gradients each call."""
    import torch

    inputs = [a.detach().requires_grad_(i in grad_pos) if isinstance(a, torch.Tensor) else a
              for i, a in enumerate(args)]
    grad_out: list[torch.Tensor] = []

    def step() -> None:
        for i in grad_pos:
            inputs[i].grad = None
        out = fn(*inputs, **kwargs)
        if not grad_out:
            gen = torch.Generator(device=out.device).manual_seed(0)
            grad_out.append(torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype))
        out.backward(grad_out[0])

    return step


def _time(step: Callable[[], None], device: str, warmup: int, repeat: int) -> float:
    """Median seconds per call: `triton.testing.do_bench` on CUDA (CUDA events around each call, L2 cache
    flushed between calls, no host sync per call in the timing), wall clock + sync on the CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        for _ in range(max(warmup, 1)):  # compiles, autotunes
            step()
        # do_bench's warmup and rep are milliseconds; it picks the number of calls itself
        return do_bench(step, warmup=25, rep=max(25, 10 * repeat), return_mode="median") / 1e3
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def trainer_baseline(op: str, device: str, use_compile: bool, shape: dict[str, Any]) -> tuple[str, Callable[..., Any]]:
    """(name, function) of what the trainer runs for `op` when `optimization.kernels` is off."""
    import torch

    from seqtrain.kernels import reference

    if op == "attention":
        from seqtrain.models import layers

        if shape.get("docs"):
            name = "flex_attention, block mask (trainer)" if device == "cuda" and layers.flex_available() \
                else "SDPA with a document mask (trainer)"
        else:
            name = "SDPA is_causal" + (", enable_gqa" if shape.get("kv_heads", 0) != shape.get("heads") else "") + \
                " (trainer)"
        return name, layers.attention
    if use_compile:
        return "torch.compile(reference) (trainer's compiled blocks)", torch.compile(getattr(reference, op),
                                                                                      dynamic=False)
    return "PyTorch reference (trainer, eager)", getattr(reference, op)


def _bench_impl(step: Callable[[], None], device: str, warmup: int, repeat: int) -> dict[str, Any]:
    from seqtrain.kernels.memory import peak_bytes

    try:
        seconds = _time(step, device, warmup, repeat)
        peak = peak_bytes(step, device)
    except Exception as exc:  # noqa: BLE001 - one failing implementation must not hide the others
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
    return {"ms": _sig(seconds * 1e3), "peak_mb": _sig(peak / 2**20)}


def _bench_case(op: str, shape: dict[str, Any], device: str, dtype: Any, use_compile: bool, warmup: int,
                repeat: int) -> dict[str, Any]:
    import torch

    import seqtrain.kernels as K
    from seqtrain.kernels import accuracy, reference

    args64, _, grad_pos = accuracy.make_inputs(op, device, seed=0, **shape)
    args = accuracy.cast_args(args64, dtype)
    del args64
    row: dict[str, Any] = {"op": op, "shape": shape}
    row["kernel"] = _bench_impl(_step_fn(getattr(K, op), args, grad_pos, {}), device, warmup, repeat)
    row["reference"] = _bench_impl(_step_fn(getattr(reference, op), args, grad_pos, {}), device, warmup, repeat)
    if use_compile:
        torch._dynamo.reset()
        compiled = torch.compile(getattr(reference, op), dynamic=False)
        row["compiled"] = _bench_impl(_step_fn(compiled, args, grad_pos, {}), device, warmup, repeat)
    name, fn = trainer_baseline(op, device, use_compile, shape)
    if op != "attention" and use_compile:
        row["baseline"] = {"name": name, **row["compiled"]}  # the same function: not timed twice
    else:
        row["baseline"] = {"name": name, **_bench_impl(_step_fn(fn, args, grad_pos, {}), device, warmup, repeat)}
    base = row["baseline"]
    if "ms" in base and "ms" in row["kernel"] and row["kernel"]["ms"]:
        row["speedup_vs_baseline"] = _sig(base["ms"] / row["kernel"]["ms"])
    ref, ker = row["reference"], row["kernel"]
    if "ms" in ref and "ms" in ker:
        row["speedup"] = _sig(ref["ms"] / ker["ms"]) if ker["ms"] else None
        row["memory_ratio"] = _sig(ker["peak_mb"] / ref["peak_mb"]) if ref["peak_mb"] else None
    return row


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


def _accuracy(op: str, device: str) -> list[dict[str, Any]]:
    import torch

    from seqtrain.kernels import accuracy, poison_outputs

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        with poison_outputs():
            res = accuracy.measure(op, dtype, device, **ACCURACY_SHAPES[op])
        out.append({"dtype": res["dtype"], "shape": res["shape"], "kernel": res["kernel"],
                    "reference": res["reference"], "max_kernel_error": max(res["kernel"].values()),
                    "max_reference_error": max(res["reference"].values()), "passes": not accuracy.violations(res)})
    return out


def _fmt(impl: dict[str, Any] | None) -> str:
    if impl is None:
        return "-"
    if "error" in impl:
        return "error"
    return f"{impl['ms']:.3f} ms / {impl['peak_mb']:.1f} MB"


def _print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'op':22} {'shape':44} {'kernel':24} {'reference':24} {'compiled':24} {'baseline':24} "
              f"{'vs base':>8} {'mem':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        shape = ",".join(f"{k}={v}" for k, v in r["shape"].items()).replace(" ", "")
        print(f"{r['op']:22} {shape[:44]:44} {_fmt(r['kernel']):24} {_fmt(r['reference']):24} "
              f"{_fmt(r.get('compiled')):24} {_fmt(r.get('baseline')):24} {r.get('speedup_vs_baseline') or '-':>8} "
              f"{r.get('memory_ratio') or '-':>7}")
        for name in ("kernel", "reference", "compiled", "baseline"):
            if isinstance(r.get(name), dict) and "error" in r[name]:
                print(f"    {name}: {r[name]['error']}")


def patch_interpreter_for_numpy() -> str | None:
    """Let Triton's CPU interpreter index with its scalars under numpy >= 2.5; returns what was patched, or None.

    Triton 3.6's interpreter gives its tensors `__index__ = int(handle.data)`, where a scalar's data is a
    1-element array: numpy 2.5 refuses `int()` of an array with a dimension (TypeError), so any `range()` over a
    bound derived from `tl.program_id` fails there, the lent GPU machine's pair (torch 2.11, triton 3.6, numpy
    2.5.2). Only the interpreter is touched (a GPU compiles the kernels and never runs this code): the same
    conversion, through `.item()`, which numpy allows for any 1-element array. Triton restores the attribute after
    each launch as it does its own."""
    import numpy as np

    if tuple(int(v) for v in np.__version__.split(".")[:2]) < (2, 5):
        return None
    try:
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 - no triton (or no interpreter): nothing to patch
        return None
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "seqtrain_numpy_fix", False):
        return None if original is None else "triton interpreter: tensor.__index__ via .item() (numpy >= 2.5)"

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched.seqtrain_numpy_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
    return "triton interpreter: tensor.__index__ via .item() (numpy >= 2.5)"


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("seqtrain bench kernels: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2
    interpreter_fix = None
    if device == "cpu":
        # Must precede the first import of seqtrain.kernels.ops (triton reads it when decorating).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        interpreter_fix = patch_interpreter_for_numpy()
    import seqtrain.kernels as K

    probe = torch.zeros(1, device=device)
    try:
        if K.backend_for(probe) != "triton":
            raise RuntimeError("the automatic choice is the PyTorch reference")
    except (RuntimeError, ValueError) as exc:
        print(f"seqtrain bench kernels: the Triton path cannot run on {device}: {exc}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device == "cuda" else torch.float32)
    shapes = args.shapes if args.shapes != "auto" else ("realistic" if device == "cuda" else "small")
    use_compile = args.compile == "on" or (args.compile == "auto" and device == "cuda")
    repeat = args.repeat or (20 if device == "cuda" else 2)
    warmup = args.warmup if args.warmup >= 0 else (3 if device == "cuda" else 0)

    rows, accuracy_rows = [], {}

    def result() -> dict[str, Any]:
        return {
            "benchmark": "kernels",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "seqtrain bench kernels " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name() if device == "cuda" else
            f"cpu ({platform.processor() or platform.machine()})",
            "kernel_runs_on": "triton" if device == "cuda" else "triton interpreter (times are not speeds)",
            "interpreter_fix": interpreter_fix,
            "timer": "triton.testing.do_bench (CUDA events), median" if device == "cuda" else
            "wall clock + sync, median",
            "memory_measure": "cuda max_memory_allocated" if device == "cuda" else "live torch tensors (dispatch mode)",
            "dtype": str(dtype).replace("torch.", ""), "shapes": shapes, "repeat": repeat, "warmup": warmup,
            "torch": torch.__version__, "triton": _triton_version(), "results": rows, "accuracy": accuracy_rows,
        }

    def write() -> None:  # after every row: a run stopped at a deadline keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(result(), indent=2) + "\n")
            tmp.replace(args.out)

    for op in args.ops.split(","):
        for shape in args.shape or SHAPES[shapes][op]:
            rows.append(_bench_case(op, shape, device, dtype, use_compile, warmup, repeat))
            write()
            if device == "cuda":
                torch.cuda.empty_cache()
        if not args.no_accuracy:
            accuracy_rows[op] = _accuracy(op, device)
            write()
    _print_table(rows)
    if accuracy_rows:
        print("\naccuracy vs float64 (max relative error over output and gradients, kernel / reference):")
        for op, accs in accuracy_rows.items():
            cells = "  ".join(f"{a['dtype']}: {a['max_kernel_error']:.2e} / {a['max_reference_error']:.2e}"
                              f"{'' if a['passes'] else ' FAIL'}" for a in accs)
            print(f"  {op:22} {cells}")
    if args.out:
        write()
        print(f"\nwrote {args.out}")
    failed = any(not a["passes"] for accs in accuracy_rows.values() for a in accs)
    errors = any("error" in r.get(k, {}) for r in rows for k in ("kernel", "reference"))
    return 1 if failed or errors else 0


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # noqa: BLE001
        return None
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
