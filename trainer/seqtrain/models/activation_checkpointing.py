"""Activation checkpointing policies: trade recomputation in backward for activation memory.

Transformer models (`model.blocks`):
- full:      every block keeps only its input; everything inside is recomputed in backward.
- every:     every k-th block (index % k == 0) is checkpointed, the others keep all activations.
- sqrt:      the L blocks are cut into about sqrt(L) segments; each segment keeps only its input
             (Chen et al. 2016), so stored inputs and the recompute working set are both ~sqrt(L) blocks.
- selective: inside each block, the sub-modules holding weight matrices (attention, MLP) are checkpointed;
             the cheap-to-store residual stream and norm outputs stay, the large internals (q/k/v, attention
             outputs, the 3 x ffn-wide MLP intermediates) are recomputed.
Recurrent models (`model.layers` + `time_chunks` support): every policy but `none` runs the whole layer
stack over about sqrt(T) time chunks, each checkpointed with the recurrent state at its start, so the
stored activations grow as sqrt(T) instead of T.

Policies are applied by replacing `forward` on the module instances, never by wrapping modules, so parameter
names (and therefore checkpoints) are the same with and without checkpointing. Recomputation restores the RNG
state (dropout masks match), so gradients equal those without checkpointing.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from seqtrain.spec.optimization import ActivationCheckpointingSpec

POLICIES = ("none", "full", "every", "sqrt", "selective")

# Meters (SavedActivationMeter) that want to hear about the inputs a checkpoint region keeps alive.
_METERS: list[SavedActivationMeter] = []
_segment_state = threading.local()


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant checkpoint (works with kwargs, None args and no-grad inputs); RNG state preserved."""
    for meter in _METERS:
        meter.note_held(args)
    return _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _patch_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    if hasattr(module, "_ac_original_forward"):
        raise RuntimeError(f"activation checkpointing was already applied to {type(module).__name__}")
    module._ac_original_forward = module.forward
    module.forward = forward


def _checkpointed(module: nn.Module) -> None:
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return original(*args, **kwargs)
        return checkpoint(original, *args, **kwargs)

    _patch_forward(module, forward)


def segments(num_blocks: int, policy: str, every: int = 2) -> list[tuple[int, int]]:
    """Half-open block ranges [start, end) that are checkpointed as one unit under `policy`."""
    if policy in ("none", "selective"):
        return []
    if policy == "full":
        return [(i, i + 1) for i in range(num_blocks)]
    if policy == "every":
        return [(i, i + 1) for i in range(0, num_blocks, every)]
    if policy == "sqrt":
        n_seg = max(1, round(math.sqrt(num_blocks)))
        size = math.ceil(num_blocks / n_seg)
        return [(s, min(s + size, num_blocks)) for s in range(0, num_blocks, size)]
    raise ValueError(f"spec.optimization.activationCheckpointing.policy: unknown policy {policy!r}; "
                     f"use one of {', '.join(POLICIES)}")


def _checkpoint_segment(blocks: Sequence[nn.Module], start: int, end: int) -> None:
    """Block `start` runs blocks start..end-1 under one checkpoint; the others pass their input through
    when called from the model's own loop (they run for real inside the segment)."""
    members = list(blocks[start:end])
    originals = [b.forward for b in members]

    def run_segment(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        prev = getattr(_segment_state, "inside", False)
        _segment_state.inside = True
        try:
            for block in members:
                x = block(x, *args, **kwargs)  # through __call__ so module hooks (FSDP, profiling) still fire
        finally:
            _segment_state.inside = prev
        return x

    def head_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if getattr(_segment_state, "inside", False):
            return originals[0](x, *args, **kwargs)
        if not torch.is_grad_enabled():
            return run_segment(x, *args, **kwargs)
        return checkpoint(run_segment, x, *args, **kwargs)

    def make_member_forward(i: int) -> Callable[..., torch.Tensor]:
        def member_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if getattr(_segment_state, "inside", False):
                return originals[i](x, *args, **kwargs)
            return x  # already applied by the segment's head block

        return member_forward

    _patch_forward(members[0], head_forward)
    for i, block in enumerate(members[1:], start=1):
        _patch_forward(block, make_member_forward(i))


def _heavy_children(block: nn.Module) -> list[nn.Module]:
    """Direct children that own a weight matrix (attention, MLP), as opposed to norms and dropout."""
    return [c for c in block.children() if any(p.ndim >= 2 for p in c.parameters())]


def time_chunks_for(seq_len: int, spec: ActivationCheckpointingSpec) -> int:
    return spec.time_chunks or max(1, round(math.sqrt(seq_len)))


def apply_activation_checkpointing(model: nn.Module, spec: ActivationCheckpointingSpec, seq_len: int) -> str:
    """Apply `spec.policy` to `model` in place; returns a one-line description for the logs."""
    policy = spec.policy
    if policy == "none":
        return "activation checkpointing: none"
    if hasattr(model, "blocks"):
        blocks = model.blocks
        if policy == "selective":
            count = 0
            for block in blocks:
                heavy = _heavy_children(block)
                if not heavy:
                    raise ValueError(f"policy selective: block {type(block).__name__} has no sub-module with weight "
                                     "matrices to recompute; use policy full")
                for child in heavy:
                    _checkpointed(child)
                    count += 1
            return f"activation checkpointing: selective ({count} attention/MLP modules recomputed)"
        segs = segments(len(blocks), policy, spec.every)
        for start, end in segs:
            if end - start == 1:
                _checkpointed(blocks[start])
            else:
                _checkpoint_segment(blocks, start, end)
        return f"activation checkpointing: {policy} ({len(segs)} checkpointed segments of {len(blocks)} blocks)"
    if getattr(model, "supports_time_chunks", False):
        chunks = time_chunks_for(seq_len, spec)
        model.ac_time_chunks = chunks
        return f"activation checkpointing: {chunks} time chunks over {seq_len} steps"
    raise ValueError(f"spec.optimization.activationCheckpointing: {type(model).__name__} supports neither block "
                     "nor time-chunk checkpointing; use policy none")


class SavedActivationMeter:
    """Bytes held for backward by a forward pass, device-independent, counted per storage (views counted once).

    Two sources: tensors autograd saves (`saved_tensors_hooks`), and inputs that a checkpointed region keeps
    alive for its recomputation (a non-reentrant checkpoint saves nothing through the hooks). Parameters and
    buffers are not activations and are excluded.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in self._exclude:
            self.storages[ptr] = st.nbytes()

    def note_held(self, args: Iterable[Any]) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self._add(a)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    @contextmanager
    def measure(self) -> Iterator[SavedActivationMeter]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self._add(t)
            return t

        _METERS.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            _METERS.remove(self)


def run_time_chunked(
    step: Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]],
    inputs: torch.Tensor,
    state: tuple[torch.Tensor, ...],
    chunks: int,
    use_checkpoint: bool,
    extra: Sequence[torch.Tensor | None] = (),
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Run `step(inputs[:, t0:t1], *state, *extra[:, t0:t1]) -> (out, new_state)` over `chunks` time chunks.

    With `use_checkpoint` each chunk keeps only its (small) inputs and the state at its start; its internals
    are recomputed in backward. `extra` are per-time-step side inputs (e.g. reset masks) sliced like inputs.
    """
    t = inputs.shape[1]
    size = max(1, math.ceil(t / max(1, chunks)))
    outs = []
    for t0 in range(0, t, size):
        t1 = min(t, t0 + size)
        ex = [None if e is None else e[:, t0:t1] for e in extra]
        if use_checkpoint and torch.is_grad_enabled():
            out, state = checkpoint(step, inputs[:, t0:t1], *state, *ex)
        else:
            out, state = step(inputs[:, t0:t1], *state, *ex)
        outs.append(out)
    return torch.cat(outs, dim=1), state
