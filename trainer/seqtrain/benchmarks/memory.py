"""`seqtrain bench memory`: activation memory per checkpointing policy and sequence length; packing efficiency.

For one GPT and one LSTM configuration, every activation-checkpointing policy and several sequence lengths:
- saved_bytes: what the forward pass keeps for backward (saved-tensor hooks plus the inputs checkpointed regions
  hold; `SavedActivationMeter`), device-independent; saved_model_bytes: the same for the model alone, without
  the output projection and loss (which no policy touches);
- peak_bytes: peak memory of one forward + backward above the weights (CUDA allocator on GPU; on the CPU the
  live bytes of every tensor torch creates, `seqtrain.kernels.memory`);
- step_s: time of that forward + backward (CPU times are only indicative).
The model's output projection and loss are included, as in training. Packing: tokens/slots for packing,
padding (one document piece per row, padded to seqLen) and bucketing (padded to the longest row of each
micro-batch) on the built-in corpus, at several sequence lengths.

    seqtrain bench memory --out memory.json
    seqtrain bench memory --baseline     # what a rank process holds beside its model: BASELINE_BYTES
    seqtrain bench memory --device cuda --gpt-dim 1024 --gpt-layers 16 --seq-lens 1024,2048,4096
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import platform
import sys
import time
from typing import Any

import torch

from seqtrain.data.builtin import Corpus
from seqtrain.models import build_model, count_parameters
from seqtrain.models.activation_checkpointing import SavedActivationMeter, apply_activation_checkpointing
from seqtrain.models.loss import linear_cross_entropy
from seqtrain.spec.model import ModelSpec
from seqtrain.spec.optimization import ActivationCheckpointingSpec

GPT_POLICIES = ["none", "full", "every", "sqrt", "selective"]
RNN_POLICIES = ["none", "full"]  # recurrent models: any policy means time-chunk checkpointing


def _measure(model: torch.nn.Module, tokens: torch.Tensor, device: torch.device) -> dict[str, Any]:
    from seqtrain.kernels.memory import peak_bytes

    targets = torch.roll(tokens, -1, dims=1)
    exclude = [*model.parameters(), *model.buffers(), tokens, targets]
    meter = SavedActivationMeter(exclude)

    def fwd_bwd() -> None:
        with meter.measure():
            loss = linear_cross_entropy(model(tokens), model.output_weight, targets)
        loss.backward()

    fwd_bwd()  # warm-up (lazy init, allocator pools); also fills the meter
    saved = meter.bytes
    body = SavedActivationMeter(exclude)  # the model alone: no output projection / loss
    with body.measure():
        model(tokens).sum().backward()
    model.zero_grad(set_to_none=True)
    peak = peak_bytes(fwd_bwd, device)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()  # timed without the CPU memory tracker's per-op overhead
    fwd_bwd()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    out = {"saved_bytes": saved, "saved_model_bytes": body.bytes, "peak_bytes": peak, "step_s": round(seconds, 4)}
    if hasattr(model, "layers") and hasattr(model, "_run"):
        # the recurrent stack alone (what time-chunk checkpointing changes): no embedding output, final norm or loss
        stack = SavedActivationMeter(exclude)
        with stack.measure():
            model._run(tokens, None, None).sum().backward()
        model.zero_grad(set_to_none=True)
        out["saved_stack_bytes"] = stack.bytes
    return out


def checkpointing_table(name: str, spec: ModelSpec, policies: list[str], seq_lens: list[int], batch: int,
                        device: torch.device) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = build_model(spec).to(device)
    rows = []
    for t in seq_lens:
        tokens = torch.randint(0, spec.vocab_size or 256, (batch, t), device=device)
        ref = None
        for policy in policies:
            model = copy.deepcopy(base)
            desc = apply_activation_checkpointing(model, ActivationCheckpointingSpec(policy=policy), t)
            m = _measure(model, tokens, device)
            ref = ref or m
            row = {"model": name, "arch": spec.arch, "params": count_parameters(base), "seq_len": t, "batch": batch,
                   "policy": policy, "detail": desc, **m,
                   "saved_ratio": round(m["saved_bytes"] / max(1, ref["saved_bytes"]), 4),
                   "saved_model_ratio": round(m["saved_model_bytes"] / max(1, ref["saved_model_bytes"]), 4),
                   "peak_ratio": round(m["peak_bytes"] / max(1, ref["peak_bytes"]), 4)}
            rows.append(row)
            stack = f" stack {m['saved_stack_bytes'] / 2**20:7.2f} MiB" if "saved_stack_bytes" in m else ""
            print(f"{name:5s} T={t:5d} {policy:9s}{stack} saved {m['saved_bytes'] / 2**20:8.2f} MiB "
                  f"(x{row['saved_ratio']:.3f}) model {m['saved_model_bytes'] / 2**20:8.2f} MiB  peak {m['peak_bytes'] / 2**20:8.2f} MiB (x{row['peak_ratio']:.3f})  "
                  f"{m['step_s']:.3f}s", flush=True)
    return rows


def packing_table(seq_lens: list[int], micro: int, steps: int) -> list[dict[str, Any]]:
    from seqtrain.data.builtin import load_builtin

    files = load_builtin("train", 0.01)
    rows = []
    for name, corpus in (("stdlib-files", files), ("stdlib-definitions", split_definitions(files))):
        rows += _packing_rows(name, corpus, seq_lens, micro, steps)
    return rows


def split_definitions(corpus: Corpus) -> Corpus:
    """The stdlib sources cut at every top-level `def`/`class`: many short documents of very varied length
    (like a corpus of code snippets or chat turns), where padding wastes most of each row."""
    import re

    import numpy as np

    data = np.asarray(corpus.tokens).tobytes()
    cuts = {int(m.start()) + 1 for m in re.finditer(rb"\n(?=def |class |async def )", data)}
    starts = np.array(sorted(cuts | set(corpus.doc_starts.tolist())), dtype=np.int64)
    return Corpus(tokens=corpus.tokens, doc_starts=starts)


def _packing_rows(name: str, corpus: Corpus, seq_lens: list[int], micro: int, steps: int) -> list[dict[str, Any]]:
    import numpy as np

    from seqtrain.data.packing import DocumentBatches, efficiency, plan_rows

    doc_len = np.diff(np.append(corpus.doc_starts, len(corpus)))
    rows = []
    for t in seq_lens:
        packed, padded = plan_rows(corpus, t, packing=True), plan_rows(corpus, t, packing=False)
        real = int(packed.row_len.sum())
        bucketed = DocumentBatches(corpus, t, micro, 1, bucketing=True, seed=0)
        plain = DocumentBatches(corpus, t, micro, 1, seed=0)
        row = {
            "corpus": name,
            "seq_len": t,
            "documents": int(len(doc_len)),
            "doc_len_median": int(np.median(doc_len)),
            "docs_shorter_than_seq_len": round(float((doc_len < t).mean()), 4),
            "packing": round(real / (packed.num_rows * t), 4),
            "padding_to_seq_len": round(real / (padded.num_rows * t), 4),
            "padding_to_batch_max": round(efficiency([b for _ in range(steps) for b in plain.next_step()]), 4),
            "bucketing": round(efficiency([b for _ in range(steps) for b in bucketed.next_step()]), 4),
            "rows_packed": packed.num_rows,
            "rows_padded": padded.num_rows,
        }
        rows.append(row)
        print(f"packing {name:18s} T={t:5d}: packed {row['packing']:.4f}  padded-to-T {row['padding_to_seq_len']:.4f}  "
              f"padded-to-batch-max {row['padding_to_batch_max']:.4f}  bucketing {row['bucketing']:.4f}", flush=True)
    return rows


BASELINE_JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: baseline}
spec:
  replicas: 2
  model: {arch: gpt, preset: tiny}
  data: {source: builtin, seqLen: 64}
  training: {steps: 4, globalBatchSize: 2, microBatchSize: 1, eval: {every: 2, batches: 2}}
  checkpoint: {intervalSteps: 2}
"""
# What a run does beside its steps is in the baseline: the built-in corpus held in memory (the largest data a
# source keeps resident), an evaluation pass and two checkpoint saves. With two steps of synthetic data the
# baseline was 706 MiB and the quickstart's ranks peaked 60-100 MiB above the estimate (a 770Mi replica passed
# validate, then was OOM-killed at every restart).


def rank_baseline(world: int = 2, timeout: float = 300.0) -> dict[str, Any]:
    """A real `world`-rank job of the tiny GPT (gloo on loopback, ranks started as the launcher starts them, four
    steps of the built-in corpus with an evaluation and two checkpoint saves): each rank's resident set when it is about to build its model (the line it logs there,
    seqtrain.train.entry), the busiest rank's peak through its steps (mem_peak_mb), and that peak less the model's
    estimate (parameters, gradients, optimizer states, activations): the process baseline of the memory estimate,
    seqtrain.spec.memory.BASELINE_BYTES."""
    import re
    import tempfile
    from pathlib import Path

    from seqtrain.parallel.launch import run_ranks
    from seqtrain.spec import load_job, resolve
    from seqtrain.spec.memory import BASELINE_MARKER, estimate

    job = resolve(load_job(BASELINE_JOB, [f"replicas={world}"]))
    with tempfile.TemporaryDirectory(prefix="seqtrain-baseline-") as tmp:
        codes = run_ranks(job, Path(tmp), world, timeout=timeout)
        logs = [p.read_text(errors="replace") for p in sorted(Path(tmp).glob("rank*.log"))]
        if codes != [0] * world:
            raise RuntimeError(f"the baseline job's ranks exited {codes}:\n" + "\n".join(t[-2000:] for t in logs))
        with open(Path(tmp) / "metrics.jsonl", encoding="utf-8") as f:
            peak = max(float(json.loads(line)["mem_peak_mb"]) for line in f) * 2**20
    pattern = re.compile(re.escape(BASELINE_MARKER) + r"(\d+) bytes")
    model = estimate(job).busiest.total
    return {"before_model_bytes": [int(m.group(1)) for t in logs for m in pattern.finditer(t)],
            "peak_bytes": int(peak), "model_estimate_bytes": int(model), "baseline_bytes": int(peak - model)}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqtrain bench memory", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-lens", default="128,256,512", help="GPT sequence lengths")
    p.add_argument("--rnn-seq-lens", default="128,512,2048", help="LSTM sequence lengths")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--gpt-dim", type=int, default=256)
    p.add_argument("--gpt-layers", type=int, default=9)
    p.add_argument("--lstm-dim", type=int, default=256)
    p.add_argument("--lstm-layers", type=int, default=2)
    p.add_argument("--packing-seq-lens", default="256,1024,4096")
    p.add_argument("--packing-steps", type=int, default=200, help="micro-batches sampled for padded/bucketed")
    p.add_argument("--skip-packing", action="store_true")
    p.add_argument("--skip-checkpointing", action="store_true")
    p.add_argument("--baseline", action="store_true", help="only measure what a rank process holds beside its model "
                   "(the estimate's process baseline) and exit")
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout only)")
    args = p.parse_args(argv)
    if args.baseline:
        from seqtrain.spec.memory import BASELINE_BYTES

        got = rank_baseline()
        print(json.dumps({"benchmark": "memory-baseline", **got, "baseline_mib": round(got["baseline_bytes"] / 2**20, 1),
                          "estimate_baseline_mib": round(BASELINE_BYTES / 2**20, 1), "torch": torch.__version__}))
        return 0
    device = torch.device(args.device)
    heads = max(1, args.gpt_dim // 64)
    gpt = ModelSpec(arch="gpt", vocab_size=256, dim=args.gpt_dim, layers=args.gpt_layers, heads=heads,
                    kv_heads=heads, ffn_dim=(int(8 * args.gpt_dim / 3) + 7) // 8 * 8,
                    max_seq_len=max(_ints(args.seq_lens)))
    lstm = ModelSpec(arch="lstm", vocab_size=256, dim=args.lstm_dim, layers=args.lstm_layers,
                     max_seq_len=max(_ints(args.rnn_seq_lens)))
    result: dict[str, Any] = {
        "benchmark": "memory",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "command": "seqtrain bench memory " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if not args.skip_checkpointing:
        result["checkpointing"] = (
            checkpointing_table("gpt", gpt, GPT_POLICIES, _ints(args.seq_lens), args.batch, device)
            + checkpointing_table("lstm", lstm, RNN_POLICIES, _ints(args.rnn_seq_lens), args.batch, device))
    if not args.skip_packing:
        result["packing"] = packing_table(_ints(args.packing_seq_lens), micro=8, steps=args.packing_steps)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
