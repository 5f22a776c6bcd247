"""Which runs shard before anything is allocated (`shards_first`), and that a GPT initialised through the shard
writer equals the one built for real (the multi-rank halves are the FSDP2 / ZeRO-3 loss-parity layouts and
tests/integration/test_sharded_init.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from seqtrain.models import build_model
from seqtrain.models.materialize import materialize, new_model, shards_first
from seqtrain.spec import apply_overrides, parse_job, resolve

BASE = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "s"},
        "spec": {"model": {"arch": "gpt", "preset": "tiny"}, "data": {"seqLen": 16}}}


def job(*sets: str):
    return resolve(parse_job(apply_overrides(copy.deepcopy(BASE), list(sets))))


@pytest.mark.parametrize(("sets", "dp", "want"), [
    (["optimization.engine=native", "optimization.zero.stage=3"], 2, "fsdp2"),
    (["optimization.engine=deepspeed", "optimization.zero.stage=3"], 4, "zero3"),
    (["optimization.engine=deepspeed", "optimization.zero.stage=3", "optimization.zero.offload=cpu"], 2, "zero3"),
    (["optimization.engine=native", "optimization.zero.stage=3"], 1, None),  # nothing to shard over
    (["optimization.engine=deepspeed", "optimization.zero.stage=2"], 2, None),  # parameters are replicated
    ([], 2, None),  # DDP
    (["model.arch=lstm", "model.heads=null", "model.ffnDim=null", "optimization.engine=native",
      "optimization.zero.stage=3"], 2, None),  # recurrent models are built for real (no streaming init)
], ids=["fsdp2", "zero3", "zero3-offload", "fsdp2-dp1", "zero2", "ddp", "lstm"])
def test_shards_first(sets: list[str], dp: int, want: str | None) -> None:
    assert shards_first(job(*sets), dp) == want


def test_meta_then_materialised_equals_the_model_built_for_real() -> None:
    spec = job().spec.model
    torch.manual_seed(3)
    ref = build_model(spec)
    torch.manual_seed(3)
    got = materialize(new_model(spec), torch.device("cpu"))
    assert got.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k
    assert torch.equal(got.rope_cos, ref.rope_cos) and got.embed.weight is got.output_weight  # buffers, tied
