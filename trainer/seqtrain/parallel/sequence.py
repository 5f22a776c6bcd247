"""Megatron-style sequence parallel (Korthikanti et al. 2022), layered on `seqtrain.parallel.tensor`.

Tensor parallel leaves the residual stream, the norms and dropout replicated on every tp rank: each stores the
same [B, T, D] activations. Sequence parallel shards those regions along the sequence (dim 1): every rank keeps
T/tp positions, and the two identity/all-reduce pairs of each sublayer become

    column-parallel input:   all-gather along T   (backward: reduce-scatter)   instead of f (identity / all-reduce)
    row-parallel output:     reduce-scatter along T (backward: all-gather)     instead of g (all-reduce / identity)

An all-reduce moves the same bytes as a reduce-scatter plus an all-gather, so the communication volume is
unchanged, while the norm inputs/outputs, residual stream and dropout masks shrink by tp. The column-parallel
projections (q/k/v, gate/up) run in one function that keeps only this rank's input shard for backward and
all-gathers it again there (paper section 4.2.2): the gathered [B, T, D] input is never stored.

The vocabulary-parallel embedding reduce-scatters its partial lookups; the final norm runs on the shard; the
loss all-gathers the hidden states before the vocabulary-sharded output projection (reduce-scatter backward).
Norm weights are replicated but see only T/tp positions per rank: their gradient is all-reduced over the tp
group inside backward (`copy_to_tp` on the weight), so every engine (DDP, FSDP2, pipeline) gets full gradients
without a separate step, at the cost of one small all-reduce per norm and micro-batch.

Sequences whose length is not a multiple of tp (document rows padded to the longest of a micro-batch) are
padded at the end by the model and the padding is dropped before the loss; causal attention never lets a real
position see it. Dropout masks differ per rank, as they must for disjoint positions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from seqtrain import kernels as K
from seqtrain.models.gpt import GPT
from seqtrain.models.layers import RMSNorm, rms_norm, swiglu
from seqtrain.parallel.tensor import (
    TPAttention,
    TPSwiGLU,
    VocabParallelEmbedding,
    VocabParallelLMLoss,
    copy_to_tp,
)

# torch >= 2.13 names; the older ones are deprecated there but are the only ones before
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_seq(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[B, t, ...] shards of every tp rank -> [B, size * t, ...], rank order along the sequence."""
    b, t = x.shape[0], x.shape[1]
    buf = torch.empty((size * b, *x.shape[1:]), dtype=x.dtype, device=x.device)  # rank-major, as c10d wants
    _all_gather_single(buf, x.contiguous(), group=group)
    return buf.view(size, *x.shape).movedim(0, 1).reshape(b, size * t, *x.shape[2:])


def reduce_scatter_seq(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[B, T, ...] partial sums on every tp rank -> this rank's [B, T / size, ...] slice of their sum."""
    b, t = x.shape[0], x.shape[1]
    if t % size:
        raise ValueError(f"sequence parallel: {t} positions cannot be split over tensorParallel {size}; "
                         "spec.data.seqLen must be a multiple of tensorParallel")
    chunks = x.reshape(b, size, t // size, *x.shape[2:]).movedim(1, 0)  # [size, B, t/size, ...]
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, chunks.reshape(size * b, *chunks.shape[2:]), group=group)  # rank-major input
    return out


class _GatherFromSP(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter of the (partial) gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return all_gather_seq(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_seq(grad, ctx.group, ctx.size), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter along the sequence forward (sums the row-parallel partial outputs); all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return reduce_scatter_seq(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_seq(grad, ctx.group, ctx.size), None, None


def gather_from_sp(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    return _GatherFromSP.apply(x, group, size)


def reduce_scatter_to_sp(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, group, size)


class _GatherLinears(torch.autograd.Function):
    """Column-parallel projections of the all-gathered input: x shard [B, t, D] -> (gather(x) @ w.T for each w).

    Backward re-gathers x (only the shard was saved), returns each weight's gradient and reduce-scatters the
    summed input gradient. Under autocast the shard is cast to the autocast dtype first, as autocast's linear
    would cast its input, so the saved shard and both all-gathers are in that dtype. `fused`
    (`optimization.fusedProjections`, as `seqtrain.models.layers.fused_linear`): one GEMM on the concatenated
    weights in forward, and one each for the input and the weight gradients in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, fused: bool,
                *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        xc = x.to(dtype)
        full = all_gather_seq(xc, group, size)
        ctx.group, ctx.size, ctx.x_dtype, ctx.fused = group, size, x.dtype, fused
        ctx.save_for_backward(xc, *weights)
        if fused:
            y = F.linear(full, torch.cat([w.to(dtype) for w in weights]))
            return tuple(y.split([w.shape[0] for w in weights], dim=-1))
        return tuple(F.linear(full, w.to(dtype)) for w in weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xc, *weights = ctx.saved_tensors
        full = all_gather_seq(xc, ctx.group, ctx.size)  # again: forward kept only this rank's shard
        rows = full.reshape(-1, full.shape[-1])
        if ctx.fused:
            g = torch.cat(grads, dim=-1)
            grad_full = g @ torch.cat([w.to(g.dtype) for w in weights])
            gw = g.reshape(-1, g.shape[-1]).t() @ rows.to(g.dtype)
            grad_ws = [part.to(w.dtype) for part, w in zip(gw.split([w.shape[0] for w in weights]), weights,
                                                            strict=True)]
        else:
            grad_sum: torch.Tensor | None = None
            grad_ws = []
            for g, w in zip(grads, weights, strict=True):
                part = g @ w.to(g.dtype)
                grad_sum = part if grad_sum is None else grad_sum + part
                g2 = g.reshape(-1, g.shape[-1])
                grad_ws.append((g2.t() @ rows.to(g.dtype)).to(w.dtype))
            assert grad_sum is not None
            grad_full = grad_sum
        grad_x = reduce_scatter_seq(grad_full, ctx.group, ctx.size).to(ctx.x_dtype)
        return (grad_x, None, None, None, *grad_ws)


def gather_linears(x: torch.Tensor, group: Any, size: int, *weights: torch.Tensor,
                   fused: bool = False) -> tuple[torch.Tensor, ...]:
    return _GatherLinears.apply(x, group, size, fused, *weights)


class SPRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard; the replicated weight's gradient is all-reduced over tp in backward."""

    group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.group)  # identity forward, all-reduce of the gradient backward
        if self.use_kernels:
            return K.rms_norm(x, weight, self.eps)
        return rms_norm(x, weight, self.eps)


class SPAttention(TPAttention):
    """Sequence shard in, sequence shard out: gather -> this rank's heads -> reduce-scatter."""

    sp_size: int

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None, block_mask: object | None = None) -> torch.Tensor:
        q, k, v = gather_linears(x, self.group, self.sp_size, self.q.weight, self.k.weight, self.v.weight,
                                 fused=self.fuse_projections)
        return reduce_scatter_to_sp(self.attend(q, k, v, cos, sin, doc_ids, block_mask), self.group,
                                    self.sp_size)


class SPSwiGLU(TPSwiGLU):
    """Sequence shard in, sequence shard out: gather -> this rank's hidden units -> reduce-scatter."""

    sp_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = gather_linears(x, self.group, self.sp_size, self.gate.weight, self.up.weight,
                                  fused=self.fuse_projections)
        act = K.swiglu if self.use_kernels else swiglu
        return reduce_scatter_to_sp(self.down(act(gate, up)), self.group, self.sp_size)


class SPVocabParallelEmbedding(VocabParallelEmbedding):
    """Vocabulary-parallel lookup whose partial sums are reduce-scattered along the sequence."""

    sp_size: int

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sp(self.partial(tokens), self.group, self.sp_size)


def gather_rows(hidden: torch.Tensor, targets: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """Sequence shards of the final hidden states -> [B*T, D] rows for the vocabulary-parallel projection,
    without the positions the model padded (targets has the unpadded length)."""
    full = gather_from_sp(hidden, group, size)[:, :targets.shape[1]]
    return full.reshape(-1, full.shape[-1])


class SPLMLoss(VocabParallelLMLoss):
    sp_size: int

    def rows(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return gather_rows(hidden, targets, self.group, self.sp_size)


class SequenceParallelGPT(GPT):
    """GPT whose forward returns this rank's sequence shard of the hidden states [B, T_pad / tp, D]; tokens
    (and doc_ids) are padded at the end to a multiple of tp first."""

    sp_size: int

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        pad = -tokens.shape[1] % self.sp_size
        if pad:
            tokens = F.pad(tokens, (0, pad))
            if doc_ids is not None:  # a document of its own after the last real one (no host sync)
                doc_ids = torch.cat([doc_ids, (doc_ids[:, -1:] + 1).expand(-1, pad)], dim=1)
        return super().forward(tokens, doc_ids)


def apply_sequence_parallel(model: nn.Module, size: int, group: Any) -> nn.Module:
    """Turn a tensor-parallel GPT (`apply_tensor_parallel` first) into a sequence-parallel one, in place. No new
    parameters and no new names: checkpoints are interchangeable with plain tensor parallel."""
    if size == 1:
        return model
    if not isinstance(model, GPT) or not isinstance(getattr(model, "lm_loss", None), VocabParallelLMLoss):
        raise ValueError("sequence parallel applies to a tensor-parallel GPT (apply_tensor_parallel first)")
    for block in model.blocks:
        for lin in (block.attn.q, block.attn.k, block.attn.v, block.mlp.gate, block.mlp.up):
            if lin.bias is not None:
                raise ValueError("sequence parallel's fused column-parallel projections take no bias")
        block.attn.__class__ = SPAttention
        block.mlp.__class__ = SPSwiGLU
        block.attn.sp_size = block.mlp.sp_size = size
    for mod in model.modules():
        if isinstance(mod, RMSNorm):  # block norms and the final norm: all in sequence-sharded regions
            mod.__class__ = SPRMSNorm
            mod.group = group
    model.embed.__class__ = SPVocabParallelEmbedding
    model.embed.sp_size = size
    model.lm_loss.__class__ = SPLMLoss
    model.lm_loss.sp_size = size
    model.__class__ = SequenceParallelGPT
    model.sp_size = size
    return model
