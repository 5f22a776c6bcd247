"""The layout-independent checkpoint tree for engines whose ranks hold parts of the model as plain tensors
(tensor-parallel slices, pipeline stages): renamed to the single-process names, each slice, and its optimizer
state, wrapped in a DTensor that says where it lies in the full tensor.

`seqtrain.parallel.tensor` keeps plain tensors (it says why) and a pipeline stage holds some of the blocks under
a `stage<i>.` prefix; DCP needs neither to change: a `Shard(dim)` DTensor over the tp sub-mesh gives DCP the slice's
offset and the full shape, and a name it has never seen on another rank is simply that rank's tensor. The wrappers
share storage with the engine's tensors: no copy until the manager stages an async save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Rename = Callable[[str], str | None]  # the engine's parameter name -> the single-process name (None: not saved)


class GlobalState:
    """Maps an engine's `checkpoint_state()` tree (its own parameter names, local tensors) to the single-process
    tree and back. `dims`: single-process name -> (split dim, its full size) of every tensor-parallel slice."""

    def __init__(self, model: nn.Module, rename: Rename, dims: dict[str, tuple[int, int]], mesh: Any) -> None:
        self.rename, self.dims, self.mesh = rename, dims, mesh
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # local names, local shapes
        self.back: dict[str, str] = {}  # single-process name -> this rank's name (filled by to_global)

    def _wrap(self, name: str, local_name: str, value: Any) -> Any:
        spec = self.dims.get(name)
        if spec is None or self.mesh is None or not isinstance(value, torch.Tensor):
            return value
        if tuple(value.shape) != self.shapes.get(local_name):  # e.g. AdamW's scalar step: the same on every rank
            return value
        from torch.distributed.tensor import DTensor, Shard

        dim, full = spec
        shape = list(value.shape)
        shape[dim] = full
        return DTensor.from_local(value, self.mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    def to_global(self, tree: dict[str, Any]) -> dict[str, Any]:
        model = {}
        for key, value in tree["model"].items():
            name = self.rename(key)
            if name is not None:
                self.back[name] = key
                model[name] = self._wrap(name, key, value)
        optim = {}
        for key, value in tree["optim"].items():
            # flattened names: state.<fqn>.<state key> and param_groups.<fqn>.<key> (the last part has no dot)
            kind, rest = key.split(".", 1)
            fqn, leaf = rest.rsplit(".", 1)
            name = self.rename(fqn)
            if name is not None:
                optim[f"{kind}.{name}.{leaf}"] = self._wrap(name, fqn, value) if kind == "state" else value
        return {**tree, "model": model, "optim": optim}

    def to_local(self, tree: dict[str, Any]) -> dict[str, Any]:
        """A tree `to_global` made, filled by a load, back under this rank's names as plain local tensors."""
        from torch.distributed.tensor import DTensor

        def local(value: Any) -> Any:
            return value.to_local() if isinstance(value, DTensor) else value

        optim = {}
        for key, value in tree["optim"].items():
            kind, rest = key.split(".", 1)
            name, leaf = rest.rsplit(".", 1)
            optim[f"{kind}.{self.back[name]}.{leaf}"] = local(value)
        return {**tree, "model": {self.back[k]: local(v) for k, v in tree["model"].items()}, "optim": optim}
