"""Loss parity: every distributed layout trains the tiny GPT to the same per-step losses as one process.

Real rank processes (the pod entrypoint `python -m seqtrain.train.entry`) over gloo on CPU, fp32, same seed,
same global batch (8 sequences of 32 tokens), 4 steps of AdamW with warmup + cosine and clipping at 1.0.

Tolerance: 1e-5 relative per step. The layouts compute the same sums in a different order (all-reduce
trees, per-shard partial matmuls, sharded vs whole-vector norms), which in fp32 moves a loss by about
1e-7 relative after 4 Adam steps (measured: at most 1e-7, see docs/benchmarks.md); 1e-5 leaves 100x room
for machine differences while any real mistake (a missing 1/dp, a shard applied twice, a lost tied-embedding
gradient) moves the second step's loss by 1e-3 or more. Resume on the same layout must be bit-exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from parity_util import job_for, logs, losses, metrics, run_ranks

pytestmark = pytest.mark.slow

RTOL = 1e-5
LSTM = {"model.arch": "lstm", "model.dim": 64, "model.layers": 4, "model.heads": None, "model.ffnDim": None}
NATIVE3 = {"optimization.engine": "native", "optimization.zero.stage": 3}
# checkpoints at steps 2 and 4 (the resume tests restart from 2); evaluation after steps 2 and 4 (every
# engine's eval path; with dp = 1 the validation batches are the single process's, so val_loss must agree too)
CKPT = {"checkpoint.intervalSteps": 2, "training.eval.every": 2, "training.eval.batches": 2}

# name -> (overrides, processes)
LAYOUTS: dict[str, tuple[dict, int]] = {
    "dp2": ({"replicas": 2}, 2),
    "zero1-dp2": ({"replicas": 2, "optimization.zero.stage": 1}, 2),
    "zero2-dp2": ({"replicas": 2, "optimization.zero.stage": 2}, 2),
    "zero3-dp2": ({"replicas": 2, "optimization.zero.stage": 3}, 2),
    "zero3-offload-dp2": ({"replicas": 2, "optimization.zero.stage": 3, "optimization.zero.offload": "cpu"}, 2),
    "fsdp2-dp2": ({"replicas": 2, **NATIVE3}, 2),
    # tensor-parallel slices of a meta model, sharded by FSDP2 and then initialised shard by shard
    "fsdp2-dp2xtp2": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
                       **NATIVE3}, 4),
    "tp2": ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2}, 2),
    "pp2-gpipe": ({"replicas": 2, "optimization.pipelineParallel": 2, "optimization.pipelineSchedule": "gpipe"}, 2),
    "pp2-1f1b": ({"replicas": 2, "optimization.pipelineParallel": 2, "optimization.pipelineSchedule": "1f1b"}, 2),
    "dp2xtp2": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2}, 4),
    "dp2xpp2": ({"replicas": 4, "optimization.pipelineParallel": 2}, 4),
    "pp2xtp2": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.pipelineParallel": 2,
                 "optimization.tensorParallel": 2}, 4),
    "tp2-sp": ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
                "optimization.sequenceParallel": True}, 2),
    "dp2xtp2-sp": ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
                    "optimization.sequenceParallel": True}, 4),
}

_done: dict[str, Path] = {}


def _build_deepspeed_ops_once() -> None:
    """Compile DeepSpeed's CPU communication op (about a minute on 2 cores) in this process, into the shared
    TORCH_EXTENSIONS_DIR (conftest: .cache/torch_extensions), before any rank needs it: later runs load it."""
    if "deepspeed-ops" not in _done:
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()
        _done["deepspeed-ops"] = Path()


def run(name: str, sets: dict, world: int, root: Path) -> Path:
    """Run a layout once per session (the resume tests reuse the matrix's checkpoints)."""
    if name not in _done:
        if "optimization.zero.stage" in sets and sets.get("optimization.engine") != "native":
            _build_deepspeed_ops_once()
        wd = root / name
        codes = run_ranks(job_for({**CKPT, **sets}), wd, world)
        assert codes == [0] * world, f"{name}: exit codes {codes}\n{logs(wd)}"
        _done[name] = wd
    return _done[name]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parity")


def val_losses(workdir: Path) -> dict[int, float]:
    return {m["step"]: m["val_loss"] for m in metrics(workdir) if "val_loss" in m}


def grad_norms(workdir: Path) -> dict[int, float]:
    return {m["step"]: m["grad_norm"] for m in metrics(workdir)}


def assert_parity(got: dict[int, float], ref: dict[int, float], rtol: float = RTOL,
                  steps: list[int] = [1, 2, 3, 4]) -> float:  # noqa: B006 - read only
    assert sorted(got) == sorted(ref) == steps
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref)
    assert worst <= rtol, f"losses {got} differ from the single-process {ref} by {worst:.2e} > {rtol:.0e}"
    return worst


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt_layout_matches_single_process(name: str, root: Path) -> None:
    ref = losses(run("single", {}, 1, root))
    sets, world = LAYOUTS[name]
    got = losses(run(name, sets, world, root))
    assert_parity(got, ref)
    assert ref[4] < ref[1]  # it trains
    if sets.get("optimization.sequenceParallel"):
        # Sequence parallel's norm weights get their gradient from T/tp positions per rank, summed over tp: a
        # missing sum barely moves Adam's losses (its update is scale-free) but moves the first step's
        # gradient norm by about 1e-4.
        assert_parity(grad_norms(run(name, sets, world, root)), grad_norms(run("single", {}, 1, root)))
    if world == sets.get("optimization.tensorParallel", 1) * sets.get("optimization.pipelineParallel", 1):
        want = val_losses(run("single", {}, 1, root))
        assert_parity(val_losses(run(name, sets, world, root)), want, steps=[2, 4])


def test_lstm_pipeline_matches_single_process(root: Path) -> None:
    ref = losses(run("lstm-single", LSTM, 1, root))
    got = losses(run("lstm-pp2", {**LSTM, "replicas": 2, "optimization.pipelineParallel": 2}, 2, root))
    assert_parity(got, ref)


def _resume_from_step2(src: Path, dst: Path) -> None:
    """A copy of a finished run folder that looks interrupted right after checkpoint step 2."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step-4")
    for log in dst.glob("rank*.log"):
        log.unlink()


@pytest.mark.parametrize("name", ["pp2-1f1b", "zero2-dp2"])
def test_resume_on_the_same_layout_is_exact(name: str, root: Path) -> None:
    sets, world = LAYOUTS[name]
    full = run(name, sets, world, root)
    wd = root / f"{name}-resumed"
    _resume_from_step2(full, wd)
    codes = run_ranks(job_for({**CKPT, **sets}), wd, world)
    assert codes == [0] * world, logs(wd)
    assert "resumed from step 2" in logs(wd)
    assert losses(wd) == losses(full)  # bit-exact, steps 1-2 kept from before, 3-4 recomputed


def test_fsdp2_resumes_into_a_different_data_parallel_degree(root: Path) -> None:
    """Elastic resharding: an FSDP2 checkpoint written by 2 ranks resumes on 1 (DCP reshards on load)."""
    sets, world = LAYOUTS["fsdp2-dp2"]
    full = run("fsdp2-dp2", sets, world, root)
    wd = root / "fsdp2-dp1-resumed"
    _resume_from_step2(full, wd)
    codes = run_ranks(job_for({**CKPT, **NATIVE3}), wd, 1)
    assert codes == [0], logs(wd)
    assert "resumed from step 2" in logs(wd)
    assert_parity(losses(wd), losses(run("single", {}, 1, root)))


# (written by, resumed as): every layout-independent engine reads every other's DCP checkpoint at another dp size
RESHARDS = [("dp2", "zero2-dp1"), ("zero2-dp2", "single"), ("zero3-dp2", "fsdp2-dp2"), ("fsdp2-dp2", "zero2-dp2"),
            ("zero2-dp2", "zero2-dp1"),
            # tensor parallel: its slices are saved with their place in the full tensor, so the degree may change;
            ("tp2", "single"), ("dp2", "tp2"), ("dp2xtp2", "zero2-dp2"), ("zero3-dp2", "dp2xtp2"),
            # pipeline stages: their parameters under the single-process names (the tied copy is the embedding)
            ("pp2-1f1b", "single"), ("dp2", "pp2-gpipe"), ("dp2xpp2", "tp2"), ("tp2", "dp2xpp2"), ("pp2xtp2", "dp2"),
            ("dp2xtp2", "pp2xtp2"),
            # FSDP2 over tensor parallel: each rank's dp chunk of its tp slice, placed in the full tensor
            ("fsdp2-dp2xtp2", "single"), ("dp2", "fsdp2-dp2xtp2"), ("fsdp2-dp2xtp2", "tp2"),
            ("fsdp2-dp2xtp2", "fsdp2-tp2")]
RESUMED_AS = {"single": ({}, 1), "zero2-dp1": ({"optimization.zero.stage": 2}, 1),
              # one data-parallel rank: FSDP2 shards nothing, its tensor-parallel slices stay plain tensors
              "fsdp2-tp2": ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2, **NATIVE3}, 2)}


@pytest.mark.parametrize(("src", "dst"), RESHARDS, ids=[f"{a}-to-{b}" for a, b in RESHARDS])
def test_a_checkpoint_resumes_on_another_engine_and_data_parallel_size(src: str, dst: str, root: Path) -> None:
    """The one DCP format: a checkpoint of step 2 written by `src` resumes as `dst` (another engine and/or another
    data-parallel size) and continues the single process's losses within the parity tolerance."""
    _build_deepspeed_ops_once()
    full = run(src, *LAYOUTS[src], root)
    sets, world = RESUMED_AS.get(dst) or LAYOUTS[dst]
    wd = root / f"{src}-as-{dst}"
    _resume_from_step2(full, wd)
    codes = run_ranks(job_for({**CKPT, **sets}), wd, world)
    assert codes == [0] * world, logs(wd)
    assert "resumed from step 2" in logs(wd)
    assert_parity(losses(wd), losses(run("single", {}, 1, root)))


@pytest.mark.parametrize("name", ["zero3-dp2", "fsdp2-dp2", "dp2xtp2", "dp2xpp2", "fsdp2-dp2xtp2"])
def test_consolidated_checkpoint_equals_the_single_process_weights(name: str, root: Path, tmp_path: Path) -> None:
    """`python -m seqtrain.parallel.consolidate` turns each engine's shards into the single-process state dict."""
    import torch

    from seqtrain.models import build_model
    from seqtrain.parallel.consolidate import consolidate
    from seqtrain.parallel.consolidate import main as consolidate_main

    sets, world = LAYOUTS[name]
    out = tmp_path / "full.pt"
    assert consolidate_main([str(run(name, sets, world, root) / "checkpoints" / "step-4"), str(out)]) == 0
    got = torch.load(out, weights_only=True)
    ref = consolidate(str(run("single", {}, 1, root) / "checkpoints" / "step-4"))  # the single process's DCP state
    model = build_model(job_for({}).spec.model)
    model.load_state_dict(got, strict=True)  # every name and shape of the full model
    # Absolute tolerance on weights: Adam divides by sqrt(v), so an element whose gradient is near zero turns a
    # 1e-7 reordering difference into up to a few 1e-6 after 4 steps (measured at most 9e-6). A wrong merge or
    # a lost gradient moves whole tensors by about one step, lr = 3e-3.
    for key, want in ref.items():
        assert (got[key] - want).abs().max() <= 5e-5, key
