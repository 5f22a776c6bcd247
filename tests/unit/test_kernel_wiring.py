"""`optimization.kernels` reaches the models and the loss: GPT (rms_norm, swiglu, rope, attention with doc_ids,
fused linear cross-entropy) and QRNN (linear_scan) give the reference's loss and gradients, train the same,
compose with activation checkpointing and pipeline stages, and a CPU run that does not ask for them never
imports triton.

The Triton kernels run natively on a GPU and through Triton's interpreter on the CPU (`TRITON_INTERPRET=1`, set
per test as in tests/unit/kernels/conftest.py: it must be set before the first kernel call of the process).

Tolerance (fp32): losses within 1e-5 relative, every parameter gradient within 2e-5 relative (L2 norm of the
difference over the norm of the reference). Measured on the CPU interpreter: at most 6e-7 for gradients,
losses equal to 1e-7; the kernels and the reference order their sums differently, nothing more.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seqtrain import kernels as K
from seqtrain.data import Batch
from seqtrain.models import build_model
from seqtrain.models.activation_checkpointing import apply_activation_checkpointing
from seqtrain.models.dispatch import apply_kernels, resolve_kernels, setup_kernels
from seqtrain.models.loss import CausalLMLoss, linear_cross_entropy
from seqtrain.parallel.pipeline import build_stages
from seqtrain.runtime.dist import DistContext
from seqtrain.spec import RuntimeConfig, load_job, resolve
from seqtrain.spec.features import unavailable
from seqtrain.spec.optimization import ActivationCheckpointingSpec

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
LOSS_RTOL = 1e-5
GRAD_RTOL = 2e-5
ROOT = Path(__file__).resolve().parents[2]

MODELS = {
    "gpt": "{arch: gpt, dim: 32, layers: 2, heads: 4, kvHeads: 2, ffnDim: 64, maxSeqLen: 16}",
    "qrnn": "{arch: qrnn, dim: 32, layers: 2}",
}
# What each model must run through seqtrain.kernels when they are on.
EXPECTED_OPS = {
    "gpt": {"rms_norm", "swiglu", "rope", "attention", "linear_cross_entropy"},
    "qrnn": {"rms_norm", "linear_scan", "linear_cross_entropy"},
}


def job_yaml(model: str, kernels: str = "null", steps: int = 4) -> str:
    return textwrap.dedent(f"""
        apiVersion: seqtrain.dev/v1alpha1
        kind: SeqTrainJob
        metadata: {{name: wiring}}
        spec:
          model: {model}
          data: {{seqLen: 16, packing: true}}
          training: {{steps: {steps}, globalBatchSize: 4, microBatchSize: 2, seed: 3,
                     optimizer: {{lr: 0.01}}, schedule: {{name: constant}}}}
          optimization: {{kernels: {kernels}}}
          checkpoint: {{intervalSteps: 1000}}
        """)


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Kernels on their Triton path (interpreter on the CPU); returns the names of the ops called."""
    monkeypatch.delenv("SEQTRAIN_KERNELS", raising=False)
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls: list[str] = []
    real = K._op
    monkeypatch.setattr(K, "_op", lambda name: calls.append(name) or real(name))
    return calls


def model_pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference, kernels) models with the same weights."""
    torch.manual_seed(0)
    ref = build_model(resolve(load_job(job_yaml(MODELS[arch]))).spec.model).to(DEVICE)
    ker = copy.deepcopy(ref)
    apply_kernels(ker, True)
    return ref, ker


def batch(packed: bool) -> Batch:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    targets = torch.randint(0, 256, (2, 16), generator=g)
    targets[1, 12:] = -100  # padding
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 3 + [2] * 4]) if packed else None
    return Batch(tokens=tokens, targets=targets, doc_ids=doc_ids).to(DEVICE)


def loss_and_grads(model: torch.nn.Module, b: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = CausalLMLoss(model)(b.tokens, b.targets, b.doc_ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close(loss: torch.Tensor, grads: dict[str, torch.Tensor], ref_loss: torch.Tensor,
                 ref_grads: dict[str, torch.Tensor]) -> None:
    assert abs(float(loss) - float(ref_loss)) <= LOSS_RTOL * abs(float(ref_loss)), (float(loss), float(ref_loss))
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        err = float((g - ref_grads[name]).norm() / ref_grads[name].norm())
        assert err <= GRAD_RTOL, f"{name}: gradient differs from the reference by {err:.2e}"


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("arch", ["gpt", "qrnn"])
def test_kernels_match_the_reference(arch: str, packed: bool, triton_path: list[str]) -> None:
    ref, ker = model_pair(arch)
    b = batch(packed)
    ref_loss, ref_grads = loss_and_grads(ref, b)
    assert not triton_path, "the reference path called a kernel"
    loss, grads = loss_and_grads(ker, b)
    assert set(triton_path) == EXPECTED_OPS[arch]
    assert_close(loss, grads, ref_loss, ref_grads)


def test_packed_documents_stay_apart_with_kernels(triton_path: list[str]) -> None:
    """A packed row gives each document the loss it has alone (attention and RoPE positions restart)."""
    _, ker = model_pair("gpt")
    b = batch(packed=True)
    loss_fn = CausalLMLoss(ker)
    with torch.no_grad():
        packed = loss_fn(b.tokens[:1], b.targets[:1], b.doc_ids[:1])
        alone = sum(loss_fn(b.tokens[:1, s:e], b.targets[:1, s:e]) for s, e in ((0, 5), (5, 12), (12, 16)))
    assert abs(float(packed) - float(alone)) <= LOSS_RTOL * float(alone)


def test_the_fused_loss_never_materialises_the_logits(triton_path: list[str]) -> None:
    _, ker = model_pair("gpt")
    b = batch(packed=False)
    tokens, targets = torch.cat([b.tokens] * 2), torch.cat([b.targets] * 2)  # more tokens than hidden units
    tokens_x_vocab = tokens.numel() * ker.output_weight.shape[0]

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    hidden = ker(tokens).detach().requires_grad_()
    for kernels, small in ((False, False), (True, True)):  # the reference shows that the check can fail
        Largest.numel = 0
        with Largest():
            linear_cross_entropy(hidden, ker.output_weight, targets, kernels=kernels).backward()
        assert (Largest.numel < tokens_x_vocab) == small, (kernels, Largest.numel, tokens_x_vocab)


def test_training_converges_like_the_reference(tmp_path: Path, triton_path: list[str]) -> None:
    """Liger-style convergence check through the real trainer: `optimization.kernels: true` on packed batches
    tracks the reference step by step (loss and gradient norm), and ends with the same weights."""
    from seqtrain.train.loop import Trainer

    runs = {}
    for kernels in ("false", "true"):
        job = resolve(load_job(job_yaml(MODELS["gpt"], kernels, steps=3)))
        work = tmp_path / kernels
        trainer = Trainer(job, RuntimeConfig(workdir=str(work), checkpoint_dir=str(work / "ck")), DistContext())
        trainer.setup()
        assert trainer.run() == "completed"
        lines = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
        runs[kernels] = (lines, trainer.model.state_dict())
        if kernels == "false":
            assert not triton_path
    assert set(triton_path) == EXPECTED_OPS["gpt"]
    (ref, ref_state), (ker, ker_state) = runs["false"], runs["true"]
    assert len(ref) == len(ker) == 3
    assert ref[-1]["loss"] < ref[0]["loss"]  # it trains
    for r, k in zip(ref, ker, strict=True):
        assert k["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert k["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
        assert k["tokens"] == r["tokens"]
    for name, w in ref_state.items():  # measured: at most 5e-6 (Adam's normalised steps amplify rounding)
        err = float((ker_state[name] - w).norm() / w.norm())
        assert err <= 1e-4, f"{name}: weights differ from the reference by {err:.2e} after 3 steps"


@pytest.mark.parametrize("arch", ["gpt", "qrnn"])
def test_activation_checkpointing_recomputes_through_the_kernels(arch: str, triton_path: list[str]) -> None:
    _, ker = model_pair(arch)
    ckpt = copy.deepcopy(ker)
    apply_activation_checkpointing(ckpt, ActivationCheckpointingSpec(policy="full", time_chunks=2), seq_len=16)
    b = batch(packed=True)
    loss, grads = loss_and_grads(ker, b)
    ckpt_loss, ckpt_grads = loss_and_grads(ckpt, b)
    assert_close(ckpt_loss, ckpt_grads, loss, grads)


def test_pipeline_stages_keep_the_kernels(triton_path: list[str]) -> None:
    """Stages reuse the switched blocks and pass the switch to their loss."""
    ref, ker = model_pair("gpt")
    b = batch(packed=False)
    first, last = build_stages(ker, [(0, 1), (1, 2)], [0, 1])
    staged = last.loss_sum(last(first(b.tokens)), b.targets)
    assert set(triton_path) == EXPECTED_OPS["gpt"]
    with torch.no_grad():
        whole = CausalLMLoss(ref)(b.tokens, b.targets)
    assert abs(float(staged.detach()) - float(whole)) <= LOSS_RTOL * float(whole)


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_runs_use_the_kernels(tmp_path: Path) -> None:
    """Real rank processes: tp 2 (blocks on the kernels over their local heads, vocabulary-parallel loss) and
    pp 2 (stages on the kernels, fused loss on the last one) give the single-process reference's losses."""
    from seqtrain.parallel.launch import run_ranks

    env = {} if HAS_CUDA else {"TRITON_INTERPRET": "1"}
    layouts = {"ref": ("false", 1, []), "tp2": ("true", 2, ["optimization.tensorParallel=2"]),
               "pp2": ("true", 2, ["optimization.pipelineParallel=2"])}
    losses = {}
    for name, (kernels, world, sets) in layouts.items():
        sets = [*sets, "data.packing=false", f"resources.processesPerReplica={world}"]  # pipelines take no doc_ids
        job = resolve(load_job(job_yaml(MODELS["gpt"], kernels, steps=2), sets))
        assert run_ranks(job, tmp_path / name, world, timeout=240, env=env) == [0] * world, name
        log = (tmp_path / name / "rank0.log").read_text()
        assert ("kernels: on" in log) == (kernels == "true"), log[-2000:]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in lines]
    assert "loss: vocabulary-parallel reference" in (tmp_path / "tp2" / "rank0.log").read_text()
    for name in ("tp2", "pp2"):  # measured: equal to 1e-7
        assert losses[name] == pytest.approx(losses["ref"], rel=1e-5), name


def test_seqtrain_kernels_torch_forces_the_reference(monkeypatch: pytest.MonkeyPatch,
                                                     triton_path: list[str]) -> None:
    monkeypatch.setenv("SEQTRAIN_KERNELS", "torch")
    ref, model = model_pair("gpt")
    job = resolve(load_job(job_yaml(MODELS["gpt"], "true")))
    line = setup_kernels(model, job, DEVICE)
    assert "SEQTRAIN_KERNELS=torch" in line and not model.use_kernels
    assert not any(getattr(m, "use_kernels", False) for m in model.modules())
    b = batch(packed=True)
    loss, grads = loss_and_grads(model, b)
    ref_loss, ref_grads = loss_and_grads(ref, b)
    assert not triton_path
    assert loss.equal(ref_loss) and all(g.equal(ref_grads[n]) for n, g in grads.items())


def test_resolution_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("SEQTRAIN_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_kernels(None, cpu)[0] is False  # unset: off on the CPU
    assert resolve_kernels(False, torch.device("cuda"))[0] is False  # never probes the device
    on, why = resolve_kernels(None, torch.device("cuda"))  # unset on CUDA: the reference until a GPU bench says
    assert not on and "seqtrain bench gpu" in why  # otherwise (docs/benchmarks.md); no device probe either
    on, why = resolve_kernels(True, cpu)
    assert not on and "TRITON_INTERPRET=1 is not set" in why
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels(True, cpu) == (True, "on (optimization.kernels: true; Triton interpreter)")
    assert resolve_kernels(None, cpu)[0] is False  # the interpreter alone does not switch them on
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("SEQTRAIN_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="SEQTRAIN_KERNELS=triton"):
        resolve_kernels(True, cpu)
    monkeypatch.setenv("SEQTRAIN_KERNELS", "fast")
    with pytest.raises(ValueError, match="SEQTRAIN_KERNELS='fast' is not valid"):
        resolve_kernels(True, cpu)


def test_the_spec_accepts_kernels_true() -> None:
    assert unavailable(load_job(job_yaml(MODELS["gpt"], "true"))) == []


@pytest.mark.slow
def test_a_cpu_run_that_does_not_ask_never_imports_triton(tmp_path: Path) -> None:
    """Real training steps on the CPU, kernels unset and then true without TRITON_INTERPRET: importing seqtrain
    loads no triton, no `seqtrain.kernels.ops` module is ever imported, and nothing in seqtrain imports triton.
    (PyTorch itself imports triton when it is installed: building a torch optimizer loads torch._dynamo, which
    probes for it. The finder below records the direct importer of every triton import to tell them apart.)"""
    script = textwrap.dedent(f"""
        import json, sys, traceback

        importers = []

        class Spy:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "triton":
                    frames = [f.filename for f in traceback.extract_stack()[:-1]]
                    direct = [f for f in frames if not f.startswith("<frozen") and "/importlib/" not in f]
                    importers.append(direct[-1])
                return None

        sys.meta_path.insert(0, Spy())
        import seqtrain.train.entry, seqtrain.train.loop, seqtrain.models, seqtrain.kernels
        at_import = "triton" in sys.modules
        from seqtrain.spec import RuntimeConfig, load_job, resolve
        from seqtrain.runtime.dist import DistContext
        from seqtrain.train.loop import Trainer
        sys.path.insert(0, {str(ROOT / "tests" / "unit")!r})
        from test_kernel_wiring import MODELS, job_yaml
        for kernels in ("null", "true"):
            job = resolve(load_job(job_yaml(MODELS["gpt"], kernels, steps=1)))
            work = {str(tmp_path)!r} + "/" + kernels
            Trainer(job, RuntimeConfig(workdir=work, checkpoint_dir=work + "/ck"), DistContext()).setup()
        ops = sorted(m for m in sys.modules if m.startswith("seqtrain.kernels.ops"))
        print(json.dumps(dict(at_import=at_import, ops=ops,
                              seqtrain_importers=sorted({{f for f in importers if "/seqtrain/" in f}}))))
        """)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SEQTRAIN_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "trainer"), str(ROOT / "operator"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernels: off (default on the CPU" in proc.stdout
    assert "TRITON_INTERPRET=1 is not set on this CPU run" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"at_import": False, "ops": [], "seqtrain_importers": []}


def test_unset_on_cuda_switches_on_only_the_kernels_a_lease_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """optimization.kernels unset: linear_scan (QRNN) on where Triton runs on CUDA (2.6-4.5x the reference on the
    first lease); every other op, and every op on the CPU or under SEQTRAIN_KERNELS=torch, stays the reference."""
    from seqtrain.models import dispatch

    monkeypatch.delenv("SEQTRAIN_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "_triton_runs_on", lambda device: device.type == "cuda")
    cuda = torch.device("cuda")

    def switched(arch: str, device: torch.device) -> tuple[set[str], str]:
        model = build_model(resolve(load_job(job_yaml(MODELS[arch]))).spec.model)
        line = setup_kernels(model, resolve(load_job(job_yaml(MODELS[arch]))), device)
        return {type(m).__name__ for m in model.modules() if getattr(m, "use_kernels", False)}, line

    on, line = switched("qrnn", cuda)
    assert on == {"QRNNLayer"} and line.startswith("kernels: linear_scan on by default on CUDA for 2 layer(s)")
    assert switched("gpt", cuda)[0] == set()  # attention, norms, the loss: the reference (and compile's fusion)
    assert switched("qrnn", torch.device("cpu"))[0] == set()
    monkeypatch.setenv("SEQTRAIN_KERNELS", "torch")
    assert switched("qrnn", cuda)[0] == set()
    monkeypatch.delenv("SEQTRAIN_KERNELS")
    monkeypatch.setattr(dispatch, "_triton_runs_on", lambda device: False)  # no triton on this CUDA machine
    assert switched("qrnn", cuda)[0] == set()
