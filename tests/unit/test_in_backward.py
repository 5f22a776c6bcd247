"""FSDP2's optimizer step in backward (`seqtrain.engine.in_backward`): which jobs take it, and what a non-finite
gradient does to a step that has already updated some blocks. Its exactness against the step after backward is
tested on real ranks (tests/integration/test_sharded_init.py)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from seqtrain.engine.in_backward import blocker
from seqtrain.runtime.launch import free_port
from seqtrain.spec import load_job, resolve

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: inbw}
spec:
  replicas: 2
  model: {arch: gpt, preset: tiny, maxSeqLen: 16}
  data: {seqLen: 16}
  training:
    steps: 2
    globalBatchSize: 2
    microBatchSize: 1
    seed: 3
    optimizer: {name: sgd, lr: 0.1, momentum: 0.0}
    schedule: {name: constant}
    gradClip: null
  optimization: {engine: native, zero: {stage: 3}}
"""

CPU = torch.device("cpu")


@pytest.mark.parametrize(("sets", "device", "tp", "why"), [
    ([], CPU, 1, None),
    (["training.optimizer.name=adamw"], CPU, 1, "optimizer adamw"),
    (["training.gradClip=1.0"], CPU, 1, "training.gradClip"),
    (["optimization.precision=fp16"], CPU, 1, "fp16"),
    (["optimization.precision=bf16"], CPU, 1, None),
    ([], CPU, 2, "tensor parallel"),
    (["optimization.compile=true"], CPU, 1, "optimization.compile"),
    ([], torch.device("cuda", 0), 1, "cuda"),
])
def test_which_jobs_step_in_backward(sets: list[str], device: torch.device, tp: int, why: str | None) -> None:
    got = blocker(resolve(load_job(JOB, sets)), device, tp)
    assert (got is None) if why is None else (got is not None and got.startswith(why)), got


def _worker(rank: int, port: int, poisoned: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from seqtrain.data import build_train_data
    from seqtrain.engine.fsdp import FSDPEngine
    from seqtrain.models import build_model
    from seqtrain.runtime.dist import DistContext

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ctx = DistContext(rank=rank, world_size=2, dp_rank=rank, dp_size=2, dp_group=mesh.get_group(), backend="gloo",
                      mesh=mesh)
    job = resolve(load_job(JOB))
    torch.manual_seed(0)
    model = build_model(job.spec.model)
    engine = FSDPEngine(model, job, ctx)
    assert engine.in_backward is not None
    # NaN into the gradient flowing out of `poisoned` (towards the blocks below it and the embedding)
    model.get_submodule(poisoned).register_full_backward_hook(
        lambda m, gin, gout: tuple(torch.full_like(g, float("nan")) if g is not None else None for g in gin))
    names = [n for n, _ in model.named_parameters()]
    before = [p.to_local().detach().clone() for p in model.parameters()]
    batches = build_train_data(job, rank, 2).next_step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = engine.step(batches)
    changed = [n for n, a, p in zip(names, before, model.parameters(), strict=True)
               if not torch.equal(a, p.to_local())]
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    if rank == 0:
        torch.save({"skipped": stats.skipped, "changed": changed, "finite": finite,
                    "warnings": [str(w.message) for w in caught if "in backward" in str(w.message)]}, out)
    torch.distributed.barrier()  # neither rank tears its pairs down while the other still uses them (SIGABRT)
    torch.distributed.destroy_process_group()
    # gloo's threads can abort the interpreter's shutdown (std::terminate in a C++ destructor: SIGABRT after the
    # last Python line, about 1 run in 12 here): a rank that finished leaves without running them
    os._exit(0)


def run(poisoned: str, tmp_path: Path) -> dict:
    port = free_port()
    out = str(tmp_path / f"{poisoned}.pt")
    mp.spawn(_worker, args=(port, poisoned, out), nprocs=2, join=True)
    return torch.load(out)


@pytest.mark.slow
def test_a_nan_reaching_every_block_skips_the_step_and_changes_nothing(tmp_path: Path) -> None:
    got = run("norm", tmp_path)  # the final norm: the top block, then everything below, gets NaN gradients
    assert got["skipped"] and got["changed"] == [] and got["finite"] and got["warnings"] == [], got


@pytest.mark.slow
def test_a_gradient_turning_nan_below_the_top_block_keeps_nan_out_and_says_so(tmp_path: Path) -> None:
    got = run("blocks.1.attn_norm", tmp_path)  # block 1 (the top one) is finite, block 0 and the embedding not
    assert got["skipped"] and got["finite"], got
    assert got["changed"] and all(n.startswith("blocks.1.") for n in got["changed"]), got["changed"]
    assert any("after 1 FSDP2 units were updated" in w for w in got["warnings"]), got["warnings"]
