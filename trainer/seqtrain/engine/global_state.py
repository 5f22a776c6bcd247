"""The layout-independent checkpoint tree for engines whose ranks hold parts of the model as plain tensors
(tensor-parallel slices, pipeline stages): renamed to the single-process names, each slice, and its optimizer
state, wrapped in a DTensor that says where it lies in the full tensor.

`seqtrain.parallel.tensor` keeps plain tensors (it says why) and a pipeline stage holds some of the blocks under
a `stage<i>.` prefix; DCP needs neither to change: a `Shard(dim)` DTensor over the tp sub-mesh gives DCP the slice's
offset and the full shape, and a name it has never seen on another rank is simply that rank's tensor. The wrappers
share storage with the engine's tensors: no copy until the manager stages an async save.

FSDP2 over tensor parallel shards each slice again, along dim 0 over dp: its parameters and optimizer states are
`Shard(0)` DTensors over the dp sub-mesh whose global shape is the slice's. A rank's piece is then a dp chunk of a
tp slice, which DTensor describes on a (tp, dp) mesh (`tp_dp_mesh`) as `[Shard(dim), Shard(0)]`: placements apply
left to right, tp first, so the offsets are exactly FSDP2's (both split with `torch.chunk`'s sizes). On the usual
(dp, tp) order, `[Shard(0), Shard(0)]` would put dp first and record other offsets for the vocabulary and
column-parallel slices. Replicated parameters keep FSDP2's own DTensor: already in single-process terms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Rename = Callable[[str], str | None]  # the engine's parameter name -> the single-process name (None: not saved)


def tp_dp_mesh(root: Any) -> Any:
    """This rank's (tp, dp) mesh, from the (dp, pp, tp) mesh of `seqtrain.parallel.mesh`: the same ranks with tp
    first, built without communicators (DCP and `DTensor.from_local` need only this rank's coordinate in it)."""
    from torch.distributed.device_mesh import DeviceMesh

    coord = root.get_coordinate()
    ranks = root.mesh[:, coord[1], :].transpose(0, 1).contiguous()
    return DeviceMesh(root.device_type, ranks, mesh_dim_names=("tp", "dp"), _init_backend=False,
                      _rank=int(root.mesh[tuple(coord)]))


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


class GlobalState:
    """Maps an engine's `checkpoint_state()` tree (its own parameter names, local tensors) to the single-process
    tree and back. `dims`: single-process name -> (split dim, its full size) of every tensor-parallel slice.
    `mesh`: the tp sub-mesh. `dp_mesh`: FSDP2's dp sub-mesh when it shards the slices (with `root`, the whole
    mesh, from which the (tp, dp) mesh is built); None: the slices are plain tensors."""

    def __init__(self, model: nn.Module, rename: Rename, dims: dict[str, tuple[int, int]], mesh: Any,
                 dp_mesh: Any = None, root: Any = None) -> None:
        self.rename, self.dims, self.mesh, self.dp_mesh = rename, dims, mesh, dp_mesh
        self.tp_dp = tp_dp_mesh(root) if dp_mesh is not None else None
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # local names, local (slice) shapes
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
        if isinstance(value, DTensor):  # FSDP2's dp chunk (dim 0) of this rank's tp slice
            if self.tp_dp is None or tuple(value.placements) != (Shard(0),):
                raise ValueError(f"{name}: a {value.placements} DTensor; tensor-parallel slices are plain tensors "
                                 "or FSDP2's Shard(0) over dp")
            return DTensor.from_local(value.to_local(), self.tp_dp, [Shard(dim), Shard(0)], run_check=False,
                                      shape=torch.Size(shape), stride=_contiguous_stride(shape))
        return DTensor.from_local(value, self.mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_stride(shape))

    def _unwrap(self, local_name: str, value: Any) -> Any:
        """A tensor `_wrap` made, as the engine holds it: the plain slice, or FSDP2's dp DTensor of it (the same
        storage: a load filled it in place)."""
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(value, DTensor):
            return value
        if self.tp_dp is None:  # only `_wrap` made DTensors
            return value.to_local()
        if value.device_mesh is not self.tp_dp:  # FSDP2's own (a replicated parameter's dp shard)
            return value
        shape = list(self.shapes[local_name])
        return DTensor.from_local(value.to_local(), self.dp_mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_stride(shape))

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
        """A tree `to_global` made, filled by a load, back under this rank's names and in the engine's tensors
        (plain local slices; FSDP2's own DTensors)."""
        optim = {}
        for key, value in tree["optim"].items():
            kind, rest = key.split(".", 1)
            name, leaf = rest.rsplit(".", 1)
            optim[f"{kind}.{self.back[name]}.{leaf}"] = self._unwrap(self.back[name], value)
        return {**tree, "model": {self.back[k]: self._unwrap(self.back[k], v) for k, v in tree["model"].items()},
                "optim": optim}
