"""Materialise a model built on the meta device: only the modules this rank keeps, then initialise them.

torchtitan's order: build on `meta` (no memory), parallelise (tensor-parallel slicing works on meta tensors),
then allocate on the device and initialise the weights. `keep` names the submodules this rank holds (a
pipeline rank's stages: `seqtrain.engine.pipeline.local_modules`); None keeps everything. Models without a
streaming `init_weights` (the recurrent ones, small) are built for real on the CPU with the same seed and the
kept modules moved to the device: identical values, and the device still holds only its part.
Sharding engines shard before anything is allocated (`shards_first`): FSDP2 materialises after `fully_shard`,
DeepSpeed ZeRO-3 builds under `deepspeed.zero.Init`; either way a rank allocates only its shards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from seqtrain.layout.rules import engine_of
from seqtrain.models import build_model
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.model import ModelSpec


def builds_on_meta(spec: ModelSpec) -> bool:
    return spec.arch == "gpt"


def shards_first(job: SeqTrainJob, dp_size: int) -> str | None:
    """How a model built from scratch reaches a sharding engine without any rank holding all of it: "fsdp2"
    (build on meta, `fully_shard`, then materialise and initialise the shards: FSDPEngine), "zero3" (DeepSpeed's
    zero.Init partitions each module as it is built: `seqtrain.engine.deepspeed.build_partitioned`), or None
    (materialise what this rank keeps before the engine wraps it). Fine-tuning (model.init, LoRA) loads a whole
    model first, so it is None there too."""
    s = job.spec
    if s.model.init or s.model.lora is not None or not builds_on_meta(s.model) or dp_size < 2:
        return None
    engine = engine_of(job)
    if engine == "fsdp2":
        return "fsdp2"
    return "zero3" if engine == "deepspeed" and s.optimization.zero.stage == 3 else None


def new_model(spec: ModelSpec) -> nn.Module:
    """The model of `spec`, on the meta device when it can be materialised part by part, else on the CPU."""
    if builds_on_meta(spec):
        with torch.device("meta"):
            return build_model(spec)
    return build_model(spec)


def materialize(model: nn.Module, device: torch.device, keep: Iterable[str] | None = None) -> nn.Module:
    """Allocate the kept submodules on `device` and initialise them; the rest stays where it is (meta, or the
    CPU for models built for real). Returns the model."""
    names = [""] if keep is None else sorted(set(keep))
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    for name in names:
        module = model.get_submodule(name)
        if on_meta:
            module.to_empty(device=device)
        else:
            module.to(device)
    if on_meta:
        model.init_weights(buffer_device=device)  # type: ignore[operator]
    else:
        for name, buf in list(model.named_buffers(recurse=False)):  # tables every stage reads
            setattr(model, name, buf.to(device))
    return model


def held_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that hold memory (not on the meta device), by name."""
    return {n: p for n, p in model.named_parameters() if p.device.type != "meta"}
