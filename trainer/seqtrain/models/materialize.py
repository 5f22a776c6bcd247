"""Materialise a model built on the meta device: only the modules this rank keeps, then initialise them.

torchtitan's order: build on `meta` (no memory), parallelise (tensor-parallel slicing works on meta tensors),
then allocate on the device and initialise the weights. `keep` names the submodules this rank holds (a
pipeline rank's stages: `seqtrain.engine.pipeline.local_modules`); None keeps everything. Models without a
streaming `init_weights` (the recurrent ones, small) are built for real on the CPU with the same seed and the
kept modules moved to the device: identical values, and the device still holds only its part.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from seqtrain.models import build_model
from seqtrain.spec.model import ModelSpec


def builds_on_meta(spec: ModelSpec) -> bool:
    return spec.arch == "gpt"


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
