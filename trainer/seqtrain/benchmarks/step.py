"""What one CPU training step and the start-up cost: `seqtrain bench step [--rounds N] [--out F]`.

Step: at nanoGPT's `shakespeare_char` size (4 layers, 4 heads, dim 128, block 64, batch 12, vocabulary 65) one
training step (forward, backward, AdamW, zero_grad) of seqtrain's GPT with its loss module (`CausalLMLoss`, the
loss SUM divided by the token count, as the engines do) against `BareGPT` below: a plain nn.Module with the same
block (RMSNorm, RoPE, causal SDPA, SwiGLU, tied embeddings, same parameter count) written the way a user writes
it. Both run in this process on one thread (`torch.set_num_threads(1)`), in interleaved rounds so machine noise
hits both alike; each figure is the median over every measured step, in CPU time (`time.process_time`) and wall
time. The ratio is seqtrain's median over the bare model's. A third figure, the engine's whole step
(`EngineStepper`: what `seqtrain run` executes per step, gradient clipping included), is reported beside them.

Start-up: `seqtrain run examples/quickstart.yaml` in a fresh run folder, the time from the command's start to
its first step's metrics record (metrics.jsonl), median of `--startup-runs` runs; the run is stopped there.
Writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# nanoGPT's config/train_shakespeare_char.py, with a SwiGLU MLP of the same parameter count as its 4 x dim GELU one
SIZE = {"layers": 4, "heads": 4, "dim": 128, "seq": 64, "batch": 12, "vocab": 65, "ffn": 352}
QUICKSTART = "examples/quickstart.yaml"
# what `seqtrain run` prints as each start-up phase ends: "... (building the model took 3.0s)"
PHASE = re.compile(r"\(([^()]+?) took ([0-9.]+)s")


class BareBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n1(x)
        q, k, v = (lin(h).view(b, t, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        q, k = bare_rope(q, cos, sin), bare_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def bare_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class BareGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(BareBlock(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        hd = dim // heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos[:t], self.sin[:t])
        logits = self.norm(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def seqtrain_model() -> tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """seqtrain's GPT of SIZE inside its loss module; returns (module, loss of one micro-batch)."""
    from seqtrain.models import build_model
    from seqtrain.models.loss import CausalLMLoss
    from seqtrain.spec.model import ModelSpec

    s = SIZE
    spec = ModelSpec(arch="gpt", vocab_size=s["vocab"], dim=s["dim"], layers=s["layers"], heads=s["heads"],
                     kv_heads=s["heads"], ffn_dim=s["ffn"], max_seq_len=s["seq"])
    module = CausalLMLoss(build_model(spec))

    def loss(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return module(tokens, targets) / targets.numel()

    return module, loss


def bare_model() -> tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    s = SIZE
    module = BareGPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["ffn"], s["seq"])
    for name, p in module.named_parameters():
        if p.ndim == 2:
            nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * s["layers"]) if name.endswith((".o.weight", ".w2.weight"))
                            else 0.02)
    return module, module


ENGINE_JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: step-bench}
spec:
  model: {arch: gpt, dim: %(dim)d, layers: %(layers)d, heads: %(heads)d, ffnDim: %(ffn)d, maxSeqLen: %(seq)d}
  data: {source: builtin, seqLen: %(seq)d}
  training: {steps: 1000, globalBatchSize: %(batch)d, microBatchSize: %(batch)d,
             optimizer: {lr: 0.001, betas: [0.9, 0.99]}}
"""


class EngineStepper:
    """seqtrain's whole training step: the native engine's `step` (loss normalisation, backward, gradient
    clipping at training.gradClip 1.0 as nanoGPT clips, AdamW, the schedule, the step's figures)."""

    def __init__(self, seed: int) -> None:
        from seqtrain.data import Batch
        from seqtrain.engine import build_engine
        from seqtrain.models import build_model
        from seqtrain.runtime.dist import DistContext
        from seqtrain.spec import load_job, resolve

        torch.manual_seed(seed)
        job = resolve(load_job(ENGINE_JOB % SIZE))  # the byte tokenizer's data: the model gets SIZE's vocabulary
        model = build_model(job.spec.model.model_copy(update={"vocab_size": SIZE["vocab"]}))
        self.params = sum(p.numel() for p in model.parameters())
        self.engine = build_engine(model, job, DistContext())
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, SIZE["vocab"], (SIZE["batch"], SIZE["seq"] + 1), generator=g)
        self.batch = Batch(tokens=rows[:, :-1].contiguous(), targets=rows[:, 1:].contiguous())

    def step(self) -> float:
        return self.engine.step([self.batch]).loss_sum


class Stepper:
    """One model, its AdamW (nanoGPT's settings) and a fixed batch; `step()` runs one training step."""

    def __init__(self, build: Callable[[], tuple[nn.Module, Callable[..., torch.Tensor]]], seed: int) -> None:
        torch.manual_seed(seed)
        self.module, self.loss = build()
        self.params = sum(p.numel() for p in self.module.parameters())
        decay = [p for p in self.module.parameters() if p.ndim >= 2]
        rest = [p for p in self.module.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=1e-3, betas=(0.9, 0.99))
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, SIZE["vocab"], (SIZE["batch"], SIZE["seq"] + 1), generator=g)
        self.tokens, self.targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def step(self) -> float:
        loss = self.loss(self.tokens, self.targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def time_steps(stepper: Stepper | EngineStepper, n: int) -> tuple[list[float], list[float]]:
    cpu, wall = [], []
    for _ in range(n):
        c0, w0 = time.process_time(), time.perf_counter()
        stepper.step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall


def measure_steps(rounds: int, steps: int, warmup: int, engine: bool = True) -> dict[str, Any]:
    """Interleaved rounds of `steps` steps per model (the order alternates per round); medians over all steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models: dict[str, Stepper | EngineStepper] = {"seqtrain": Stepper(seqtrain_model, 0),
                                                      "bare": Stepper(bare_model, 0)}
        if engine:
            models["seqtrain_engine"] = EngineStepper(0)
        for s in models.values():
            time_steps(s, warmup)
        cpu: dict[str, list[float]] = {k: [] for k in models}
        wall: dict[str, list[float]] = {k: [] for k in models}
        per_round = []
        for r in range(rounds):
            row = {}
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for name in order:
                c, w = time_steps(models[name], steps)
                cpu[name] += c
                wall[name] += w
                row[name] = statistics.median(c)
            per_round.append({**row, "ratio_cpu": row["seqtrain"] / row["bare"]})
    finally:
        torch.set_num_threads(threads)
    med = {k: {"cpu_ms": 1e3 * statistics.median(cpu[k]), "wall_ms": 1e3 * statistics.median(wall[k])}
           for k in models}
    return {
        "size": SIZE, "parameters": {k: m.params for k, m in models.items()},
        "threads": 1, "rounds": rounds, "steps_per_round": steps, "warmup_steps": warmup,
        "seqtrain": med["seqtrain"], "bare": med["bare"],
        "ratio_cpu": med["seqtrain"]["cpu_ms"] / med["bare"]["cpu_ms"],
        "ratio_wall": med["seqtrain"]["wall_ms"] / med["bare"]["wall_ms"],
        "ratio_cpu_per_round": [round(x["ratio_cpu"], 4) for x in per_round],
        # robust to one round that a neighbour's burst of load hit
        "ratio_cpu_median_of_rounds": statistics.median(x["ratio_cpu"] for x in per_round),
        **({"seqtrain_engine": med["seqtrain_engine"],
            "ratio_engine_cpu": med["seqtrain_engine"]["cpu_ms"] / med["bare"]["cpu_ms"]} if engine else {}),
    }


def measure_startup(config: str, runs: int, limit_s: float) -> dict[str, Any]:
    """Seconds from `seqtrain run CONFIG` starting to the first record in its metrics.jsonl (median of `runs`)."""
    exe = os.path.join(os.path.dirname(sys.executable), "seqtrain")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "seqtrain"]
    times: list[float] = []
    phases: list[dict[str, float]] = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "run")
            metrics = os.path.join(work, "metrics.jsonl")
            t0 = time.perf_counter()
            log = open(os.path.join(tmp, "out.txt"), "w+", encoding="utf-8")  # noqa: SIM115 (closed below)
            proc = subprocess.Popen([*cmd, "run", config, "--workdir", work], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            took = None
            try:
                while time.perf_counter() - t0 < limit_s and proc.poll() is None:
                    if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
                        took = time.perf_counter() - t0
                        break
                    time.sleep(0.02)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                log.seek(0)
                text = log.read()
                log.close()
            if took is None:
                raise RuntimeError(f"`{' '.join(cmd)} run {config}` wrote no metrics record within {limit_s:.0f} s "
                                   f"(exit {proc.returncode})")
            times.append(took)
            phases.append({name: float(sec) for name, sec in PHASE.findall(text)})
    names = [n for n in phases[0] if all(n in p for p in phases)]
    return {"config": config, "runs": runs, "first_step_s": statistics.median(times),
            "each_s": [round(t, 3) for t in times],
            "phases_s": {n: statistics.median(p[n] for p in phases) for n in names}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqtrain bench step", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds per model (default 6)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per model and round (default 20)")
    p.add_argument("--warmup", type=int, default=10, help="steps per model before measuring (default 10)")
    p.add_argument("--startup-runs", type=int, default=3, help="start-up measurements, 0 to skip (default 3)")
    p.add_argument("--config", default=QUICKSTART, help=f"job whose start-up is measured (default {QUICKSTART})")
    p.add_argument("--no-engine", action="store_true", help="skip the third figure: the engine's whole step")
    p.add_argument("--out", default="step-bench.json")
    a = p.parse_args(argv)
    if a.startup_runs > 0 and not os.path.exists(a.config):
        print(f"seqtrain bench step: --config {a.config}: no such file; run from the repository root or pass "
              "--config PATH (or --startup-runs 0)", file=sys.stderr)
        return 2
    step = measure_steps(a.rounds, a.steps, a.warmup, engine=not a.no_engine)
    print(f"step: seqtrain {step['seqtrain']['cpu_ms']:.2f} ms CPU ({step['seqtrain']['wall_ms']:.2f} wall), "
          f"bare {step['bare']['cpu_ms']:.2f} ms CPU ({step['bare']['wall_ms']:.2f} wall): "
          f"{step['ratio_cpu']:.3f}x CPU, {step['ratio_wall']:.3f}x wall; median of the rounds' CPU ratios "
          f"{step['ratio_cpu_median_of_rounds']:.3f}x")
    if "seqtrain_engine" in step:
        print(f"seqtrain's engine step (clipping, schedule, figures): {step['seqtrain_engine']['cpu_ms']:.2f} ms CPU: "
              f"{step['ratio_engine_cpu']:.3f}x the bare model's step")
    startup = measure_startup(a.config, a.startup_runs, 300.0) if a.startup_runs > 0 else None
    if startup:
        print(f"start-up to the first step of {a.config}: {startup['first_step_s']:.2f} s (median of "
              f"{startup['runs']}); phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in startup["phases_s"].items()))
    result = {"torch": torch.__version__, "machine": platform.platform(), "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "step": step, "startup": startup}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
