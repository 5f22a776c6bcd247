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
