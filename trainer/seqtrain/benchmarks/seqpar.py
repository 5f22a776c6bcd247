"""Saved activations per rank with tensor parallel, with and without sequence parallel.

For one GPT and a few sequence lengths: tp ranks (gloo on CPU, nccl on CUDA) each build the model, shard it
(`apply_tensor_parallel`, then `apply_sequence_parallel` for the +sp rows) and run one forward of the model
plus its vocabulary-parallel loss under `SavedActivationMeter`: the bytes autograd keeps for backward (plus the
inputs checkpointed regions hold), counted once per storage, weights excluded, device-independent. Rank 0's
figures are reported (the ranks are symmetric) next to the single-process model's and the planner's estimate
(`seqtrain_operator.planner.memory.block_activation_elems`, per block and token, x layers x tokens x bytes).

    python -m seqtrain.benchmarks.seqpar --out seqpar.json
    python -m seqtrain.benchmarks.seqpar --tp 4 --dim 512 --layers 8 --seq-lens 1024,2048 --policy full
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seqtrain.models import build_model
from seqtrain.models.activation_checkpointing import SavedActivationMeter, apply_activation_checkpointing
from seqtrain.models.loss import CausalLMLoss
from seqtrain.parallel.sequence import apply_sequence_parallel
from seqtrain.parallel.tensor import apply_tensor_parallel
from seqtrain.spec.model import ModelSpec
from seqtrain.spec.optimization import ActivationCheckpointingSpec


def gpt_spec(dim: int, layers: int, heads: int, max_seq_len: int) -> ModelSpec:
    return ModelSpec(arch="gpt", vocab_size=256, dim=dim, layers=layers, heads=heads, kv_heads=heads,
                     ffn_dim=(8 * dim // 3 + 63) // 64 * 64, max_seq_len=max_seq_len)


def saved_bytes(spec: ModelSpec, tokens: torch.Tensor, tp: int = 1, sp: bool = False, rank: int = 0,
                group: Any = None, policy: str = "none") -> dict[str, int]:
    """Bytes one rank keeps for backward: the whole forward (model + loss) and the transformer blocks alone."""
    torch.manual_seed(0)
    model = build_model(spec).to(tokens.device)
    if tp > 1:
        apply_tensor_parallel(model, rank, tp, group)
        if sp:
            apply_sequence_parallel(model, tp, group)
    apply_activation_checkpointing(model, ActivationCheckpointingSpec(policy=policy), tokens.shape[1])
    loss_module = CausalLMLoss(model)
    targets = torch.roll(tokens, -1, dims=1)
    exclude = [*model.parameters(), *model.buffers(), tokens, targets]
    total, blocks = SavedActivationMeter(exclude), SavedActivationMeter(exclude)
    with total.measure():
        loss = loss_module(tokens, targets)
    loss.backward()  # backward's collectives run too: every rank must reach the same calls
    # Second pass, the blocks alone (saved-tensor hooks do not nest: the innermost one sees a tensor).
    originals = [b.forward for b in model.blocks]

    def metered(i: int) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            with blocks.measure():
                return originals[i](*args, **kwargs)
        return forward

    for i, b in enumerate(model.blocks):
        b.forward = metered(i)
    loss_module(tokens, targets).backward()
    return {"saved_bytes": total.bytes, "saved_block_bytes": blocks.bytes}


def _rank(rank: int, tp: int, port: int, spec: ModelSpec, cases: list[dict[str, Any]], out: Any) -> None:
    cuda = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=tp)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    try:
        rows = []
        for case in cases:
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, spec.vocab_size or 256, (case["batch"], case["seq_len"]), generator=g)
            m = saved_bytes(spec, tokens.to(device), tp, case["sp"], rank, dist.group.WORLD, case["policy"])
            rows.append({**case, **m})
        if rank == 0:
            out.put(rows)
        dist.barrier()  # neither rank tears its pairs down while the other still uses them (SIGABRT)
    finally:
        dist.destroy_process_group()


def measure_tp(spec: ModelSpec, tp: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run `cases` ({seq_len, batch, sp, policy}) on `tp` spawned ranks; rank 0's rows."""
    from seqtrain.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(tp, free_port(), spec, cases, out), nprocs=tp, start_method="spawn")
    return out.get()


def planner_bytes(spec: ModelSpec, tokens: int, tp: int, sp: bool, act_bytes: int = 4) -> float:
    """The planner's estimate of the blocks' stored activations on one rank (no checkpointing)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "operator"))
    from seqtrain_operator.planner.memory import block_activation_elems

    return block_activation_elems(spec, tp, sp) * (spec.layers or 0) * tokens * act_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqtrain.benchmarks.seqpar", description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-lens", default="256,1024")
    p.add_argument("--policy", default="none", help="activation checkpointing policy of every row")
    p.add_argument("--out", help="write the JSON here (default: stdout)")
    args = p.parse_args(argv)
    seq_lens = [int(t) for t in args.seq_lens.split(",")]
    spec = gpt_spec(args.dim, args.layers, args.heads, max(seq_lens))
    cases = [{"seq_len": t, "batch": args.batch, "sp": sp, "policy": args.policy} for t in seq_lens
             for sp in (False, True)]
    tp_rows = measure_tp(spec, args.tp, cases)
    results = []
    for t in seq_lens:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 256, (args.batch, t), generator=g)
        one = saved_bytes(spec, tokens, policy=args.policy)
        plan = args.policy == "none"  # the planner figure below is for blocks without checkpointing
        results.append({"layout": "single", "seq_len": t, **one,
                        "planner_block_bytes": planner_bytes(spec, args.batch * t, 1, False) if plan else None})
        for r in (r for r in tp_rows if r["seq_len"] == t):
            name = f"tp{args.tp}" + ("+sp" if r["sp"] else "")
            results.append({"layout": name, "seq_len": t, "saved_bytes": r["saved_bytes"],
                            "saved_block_bytes": r["saved_block_bytes"],
                            "planner_block_bytes": planner_bytes(spec, args.batch * t, args.tp, r["sp"]) if plan
                            else None})
    for r in results:
        est = r["planner_block_bytes"]
        print(f"T={r['seq_len']:5d} {r['layout']:>8}: saved {r['saved_bytes'] / 2**20:8.2f} MiB, blocks "
              f"{r['saved_block_bytes'] / 2**20:8.2f} MiB" + (f" (planner {est / 2**20:8.2f} MiB)" if est else ""),
              file=sys.stderr, flush=True)
    doc = {
        "benchmark": "seqpar",
        "date": dt.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"},
        "command": "python -m seqtrain.benchmarks.seqpar " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": spec.model_dump(), "batch": args.batch, "tp": args.tp, "policy": args.policy, "precision": "fp32",
        "results": results,
    }
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
