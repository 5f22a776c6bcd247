"""The layout-independent checkpoint: one torch.distributed.checkpoint (DCP) folder, `<step dir>/state/`.

Every engine (native DDP, tensor and pipeline parallel, FSDP2 with or without tensor parallel, DeepSpeed ZeRO 0-3)
hands the manager the same tree, keyed by the single-process model's parameter names and holding full-shape tensors
(plain, or DTensors whose global shape DCP records):

    model.<fqn>                      weights
    optim.state.<fqn>.<key>          optimizer state per parameter (AdamW: exp_avg, exp_avg_sq, step)
    optim.param_groups.<fqn>.<key>   the hyper-parameters of that parameter's group
    scheduler.*                      the LambdaLR's plain state
    precision.*                      the loss scaler (native engines) / ds_loss_scale (DeepSpeed)

DCP records each tensor's global shape and every rank's chunk of it, so any data-parallel size and any of those
engines reads any other's folder (DCP reshards on load). Trainer state, data position and RNG stay seqtrain's own
small files beside it.

Async saves (`Stager`): the tree is copied into host memory on the training thread (the only part the step waits
for), then written by a background writer process (or thread); see `CheckpointManager.save` and
`seqtrain.checkpoint.writer`.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

STATE_DIR = "state"  # the DCP folder inside a step folder
FORMAT = "dcp-1"  # meta.json "format" of checkpoints with a STATE_DIR
REQUIRED_PREFIXES = ("model.", "optim.state.")  # a checkpoint lacking one of the job's keys here cannot resume it


def has_state(step_dir: str) -> bool:
    return os.path.isdir(os.path.join(step_dir, STATE_DIR))


class Stager:
    """Host-memory copies of a state tree for the background writer, in buffers reused from one save to the next.

    Allocating (and, on a GPU, pinning) a fresh copy of every tensor at each save is most of what an async save
    still blocks on: the first H100 lease measured 2.2 s to stage a 3.7 GB state into new pageable memory. A
    buffer kept per tensor is faulted in (pinned) once; later saves only copy into it (from a GPU asynchronously,
    one synchronize at the end). Reuse is safe because a save waits for the previous background write before it
    stages again (`CheckpointManager.save`). The price: one host copy of the state stays allocated between saves,
    as torchtitan's pinned staging keeps it.

    `shared`: the buffers live in shared memory, so the writer process maps them once and reads every later save
    from them without a copy (on a GPU also pinned, by registering that memory with CUDA, as DCP's staging does)."""

    def __init__(self, shared: bool = False) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._from_gpu = False
        self.shared = shared

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The host buffers by key ("/model/w"): what a staged tree's tensors are."""
        return self._buffers

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A host-memory copy of `state` that training may not touch: what the background writer saves."""
        self._from_gpu = False
        tree = self._value(state, "")
        if self._from_gpu:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are done before training goes on
        return tree

    def _host(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda" and torch.cuda.is_available()
            buf = self._buffers[key] = (_shared_buffer(tensor, pin) if self.shared else
                                        torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin))
        from_gpu = tensor.device.type == "cuda"
        self._from_gpu |= from_gpu
        buf.copy_(tensor, non_blocking=from_gpu and buf.is_pinned())
        return buf

    def _value(self, value: Any, key: str) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            local = self._host(key, value.to_local())
            return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._host(key, value)  # a copy even on the CPU: the next step updates the original
        if isinstance(value, dict):
            return {k: self._value(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._value(v, f"{key}/{i}") for i, v in enumerate(value))
        return copy.deepcopy(value)


def _shared_buffer(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host tensor like `tensor` in shared memory; pinned when `pin` and CUDA registers it (else pageable: the
    copy into it is synchronous, nothing else changes)."""
    # allocated in shared memory directly (`share_memory_()` on a fresh tensor would copy it there: 1 GB more to touch)
    nbytes = tensor.numel() * tensor.element_size()
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    stride, step = [], 1
    for dim in reversed(tensor.shape):  # contiguous
        stride.insert(0, step)
        step *= max(dim, 1)
    buf = torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape, stride)
    if pin and buf.numel() > 0:
        import weakref

        try:
            from torch.cuda import _pin_memory_utils  # torch >= 2.7 (DCP's shared, pinned staging uses it)

            _pin_memory_utils.pin_memory(buf.data_ptr(), buf.numel() * buf.element_size())
            weakref.finalize(buf, _pin_memory_utils.unpin_memory, buf.data_ptr())
        except (ImportError, RuntimeError):
            pass
    return buf


def write(state: dict[str, Any], folder: str, group: Any) -> None:
    """Collective over `group` (None: this process alone): every rank writes its chunks, rank 0 the metadata;
    files are fsynced before it returns."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(folder, sync_files=True)
    dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)


def read(folder: str, target: dict[str, Any], group: Any) -> None:
    """Fill `target` (this rank's tensors, any layout) in place from the DCP folder, through seqtrain's restricted
    readers. Keys of the job the checkpoint lacks: a missing weight or optimizer state is refused naming it;
    hyper-parameters and scheduler fields this job has and the checkpoint has not keep this job's values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from seqtrain.checkpoint.safe_load import dcp_load, read_dcp_metadata
    from seqtrain.runtime.exitcodes import InvalidConfig

    saved = read_dcp_metadata(os.path.join(folder, ".metadata")).state_dict_metadata
    wanted = _flat_keys(target)
    missing = [k for k in wanted if k.startswith(REQUIRED_PREFIXES) and k not in saved]
    if missing:
        raise InvalidConfig(f"{folder}: this checkpoint has no {missing[0]} ({len(missing)} of this job's weights "
                            "and optimizer states missing): it was written for another model; resume with the model "
                            "in its meta.json, or use a new checkpoint folder")
    for key, value in wanted.items():
        size = getattr(saved.get(key), "size", None)  # tensors only (byte items have none)
        if isinstance(value, torch.Tensor) and size is not None and tuple(size) != tuple(value.shape):
            raise InvalidConfig(f"{folder}: {key} has shape {list(size)} in the checkpoint but {list(value.shape)} "
                                "in this job: it was written for another model; resume with the model in its "
                                "meta.json, or use a new checkpoint folder")
    planner = DefaultLoadPlanner(allow_partial_load=True)
    if group is None:
        dcp_load(folder, lambda reader: _load_state_dict(target, storage_reader=reader, planner=planner,
                                                         no_dist=True))
    else:
        dcp_load(folder, lambda reader: dcp.load(target, storage_reader=reader, planner=planner,
                                                 process_group=group))


def _flat_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """DCP's flattened names for `tree` (nested dicts joined with '.'), leaves as values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat_keys(value, name + "."))
        else:
            out[name] = value
    return out
