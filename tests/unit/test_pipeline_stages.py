"""Pipeline stages: every tensor of a stage lives on the device the model was built on (a stray CPU tensor
crashes the first CUDA step, since manual PipelineStage never moves modules). Checked without a GPU by building
on the meta device: anything the stage creates on the default device shows up as a CPU tensor."""

from __future__ import annotations

import pytest
import torch

from seqtrain.models import build_model
from seqtrain.parallel.pipeline import TIED_COPY, build_stages, check_stage_device, stray_tensors
from seqtrain.spec.model import ModelSpec

GPT_SPEC = ModelSpec(arch="gpt", vocab_size=256, dim=32, layers=4, heads=4, kv_heads=2, ffn_dim=64, max_seq_len=64)
BOUNDS = [(0, 1), (1, 3), (3, 4)]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_every_stage_tensor_is_on_the_model_device(tied: bool) -> None:
    meta = torch.device("meta")
    with meta:
        model = build_model(GPT_SPEC.model_copy(update={"tie_embeddings": tied}))
    stages = build_stages(model, BOUNDS, [0, 1, 2])
    for s in stages:
        assert stray_tensors(s, meta) == []
        check_stage_device(s, meta)
    last = stages[-1]
    assert (last.output is not None) == tied
    if tied:
        assert last.output.weight.device == meta
        assert dict(last.named_parameters())[TIED_COPY].shape == (256, 32)


def test_a_stray_cpu_tensor_is_named() -> None:
    with torch.device("meta"):
        model = build_model(GPT_SPEC)
    last = build_stages(model, BOUNDS, [2])[0]
    last.output = torch.nn.Embedding(256, 32)  # what the stage used to build: on the default (CPU) device
    with pytest.raises(RuntimeError, match=rf"{TIED_COPY} \(cpu\)"):
        check_stage_device(last, torch.device("meta"))


def test_tied_copy_starts_equal_to_the_embedding() -> None:
    torch.manual_seed(0)
    model = build_model(GPT_SPEC)
    last = build_stages(model, BOUNDS, [2])[0]
    assert torch.equal(last.output.weight, model.embed.weight)
    assert last.output.weight.data_ptr() != model.embed.weight.data_ptr()


# ---- meta construction: a rank materialises only what it holds, with the single process's values -----------

JOB = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: meta}
spec:
  replicas: 2
  model: {arch: gpt, preset: tiny, layers: 4}
  data: {seqLen: 32}
  training: {globalBatchSize: 8, microBatchSize: 2}
  optimization: {pipelineParallel: 2}
"""


def _job(*sets: str):
    import yaml

    from seqtrain.spec import apply_overrides, parse_job, resolve

    return resolve(parse_job(apply_overrides(yaml.safe_load(JOB), list(sets)), check_features=False))


def _single_process(job) -> dict[str, torch.Tensor]:
    torch.manual_seed(job.spec.training.seed)
    return dict(build_model(job.spec.model).named_parameters())


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_pipeline_rank_holds_only_its_stage_with_the_single_process_weights(tied: bool) -> None:
    from seqtrain.models.materialize import held_parameters, materialize, new_model
    from seqtrain.parallel.pipeline import layout, local_modules

    job = _job(f"model.tieEmbeddings={str(tied).lower()}")
    full = _single_process(job)
    bounds, _ = layout(job, 2, 0)
    for rank in (0, 1):
        torch.manual_seed(job.spec.training.seed)
        model = materialize(new_model(job.spec.model), torch.device("cpu"), local_modules(job, 2, rank))
        held = held_parameters(model)
        start, end = bounds[rank]
        blocks = {int(n.split(".")[1]) for n in held if n.startswith("blocks.")}
        assert blocks == set(range(start, end))
        assert ("embed.weight" in held) == (rank == 0 or tied)  # the last rank copies it, then frees it
        assert ("norm.weight" in held) == (rank == 1)
        assert ("lm_head.weight" in held) == (rank == 1 and not tied)
        for n, p in held.items():
            assert torch.equal(p, full[n]), n
        stage = build_stages(model, bounds, [rank])[0]
        check_stage_device(stage, torch.device("cpu"))
        assert torch.equal(stage.rope_cos, model.rope_cos) and stage.rope_cos.device.type == "cpu"
        if rank == 1 and tied:
            assert torch.equal(stage.output.weight, full["embed.weight"])
        held_bytes = sum(p.numel() for p in stage.parameters())
        assert held_bytes < sum(p.numel() for p in full.values())


def test_tensor_parallel_slices_of_a_meta_model_equal_the_single_process_slices() -> None:
    from seqtrain.models.materialize import materialize, new_model
    from seqtrain.parallel.tensor import apply_tensor_parallel

    job = _job("optimization.pipelineParallel=1")
    full = _single_process(job)
    for rank in (0, 1):
        torch.manual_seed(job.spec.training.seed)
        model = new_model(job.spec.model)
        apply_tensor_parallel(model, rank, 2, None)
        materialize(model, torch.device("cpu"))
        for n, p in model.named_parameters():
            sl = getattr(model.get_submodule(n.rpartition(".")[0]), "tp_slice", None)
            want = full[n] if sl is None else full[n].narrow(sl[0], sl[1], p.shape[sl[0]])
            assert torch.equal(p, want), n
