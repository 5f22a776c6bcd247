"""Megatron-style tensor parallelism, hand-written on plain tensors.

Why hand-written rather than DTensor's `parallelize_module`: the model calls seqtrain's own functions
(`seqtrain.kernels` Triton ops, the reference attention/RoPE/RMSNorm) that have no DTensor sharding rules, the
DeepSpeed and DDP engines flatten plain tensors, and parity debugging wants every collective visible. The
layers below are the four operators of Shoeybi et al. (2019): the block input enters each sublayer through `f`
(identity forward, all-reduce backward), the column-parallel matrices (q/k/v, gate/up) keep their output
local, the row-parallel matrix (attention out, MLP down) produces a partial sum that `g` all-reduces
(all-reduce forward, identity backward): one all-reduce per sublayer in each direction. With
`optimization.fusedProjections` the column-parallel shards of q/k/v (gate/up) run as one GEMM through the base
classes' forward (`seqtrain.models.layers.fused_linear` splits the output by each local shard's rows).

The embedding is split by vocabulary rows; the output projection reuses the (tied) shard and the
cross-entropy runs on vocabulary-sharded logits (max, sum-exp and target logit are all-reduced), so no rank
ever holds the full [tokens, vocab] logits.

Weights are sliced from a model built on the meta device; each slice records where it lies in the full
matrix (`tp_slice`), and `GPT.init_weights` fills it with exactly the single-process values (the loss-parity
tests rely on it). A model built with real weights is sliced the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from seqtrain.data import IGNORE_INDEX
from seqtrain.models.layers import CausalSelfAttention, GeluMLP, RMSNorm, SwiGLU, rms_norm


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs), identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def _shard_rows(linear: nn.Linear, rank: int, size: int) -> None:
    """Column parallel: keep output features [rank*n/size, (rank+1)*n/size), of the weight and the bias."""
    n = linear.out_features // size
    linear.weight = nn.Parameter(linear.weight.detach()[rank * n:(rank + 1) * n].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rank * n:(rank + 1) * n].clone())
    linear.tp_slice = (0, rank * n, linear.out_features)  # weight's place in the full matrix: GPT.init_weights
    linear.out_features = n


class RowParallelLinear(nn.Linear):
    """This rank's input features: a partial sum without the bias. The bias (replicated) is added once, after the
    sum (`add_bias`), so every rank sees the same gradient for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias


def _shard_cols(linear: nn.Linear, rank: int, size: int) -> None:
    """Row parallel: keep input features of this rank; the outputs are partial sums."""
    n = linear.in_features // size
    linear.weight = nn.Parameter(linear.weight.detach()[:, rank * n:(rank + 1) * n].clone())
    linear.tp_slice = (1, rank * n, linear.in_features)
    linear.in_features = n
    linear.__class__ = RowParallelLinear


class TPHeadNorm(RMSNorm):
    """Qwen3's q/k RMSNorm on this rank's heads: the replicated weight sees only these heads, so its gradient is
    all-reduced over the tensor-parallel group in backward (`copy_to_tp`)."""

    group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.group)  # identity forward, all-reduce of the gradient backward
        if self.use_kernels:
            from seqtrain import kernels as K

            return K.rms_norm(x, weight, self.eps)
        return rms_norm(x, weight, self.eps)


class TPAttention(CausalSelfAttention):
    """The attention sublayer with this rank's heads: q/k/v column-parallel, out row-parallel."""

    group: Any

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None, block_mask: object | None = None) -> torch.Tensor:
        y = reduce_from_tp(super().forward(copy_to_tp(x, self.group), cos, sin, doc_ids, block_mask), self.group)
        return self.out.add_bias(y)


class TPSwiGLU(SwiGLU):
    """The MLP sublayer with this rank's slice of the hidden units: gate/up column-, down row-parallel."""

    group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down.add_bias(reduce_from_tp(super().forward(copy_to_tp(x, self.group)), self.group))


class TPGeluMLP(GeluMLP):
    """The GELU MLP with this rank's slice of the hidden units: up column-, down row-parallel."""

    group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down.add_bias(reduce_from_tp(super().forward(copy_to_tp(x, self.group)), self.group))


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows [start, end) of the vocabulary; tokens outside look up zeros and the sum fills them in.

    An nn.Embedding subclass so optimizer grouping (embedding learning-rate scale) treats it as one;
    `num_embeddings` stays the full vocabulary."""

    def __init__(self, full: nn.Embedding, rank: int, size: int, group: Any) -> None:
        nn.Module.__init__(self)
        per = full.num_embeddings // size
        self.start, self.end, self.group = rank * per, (rank + 1) * per, group
        self.num_embeddings, self.embedding_dim = full.num_embeddings, full.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.end].clone())
        self.tp_slice = (0, self.start, full.num_embeddings)

    def partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """This shard's rows, zeros for the other ranks' tokens: one of the tp terms whose sum is the embedding."""
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        return F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(self.partial(tokens), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies from vocabulary-sharded logits [N, V/tp] (Megatron's formulation)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, start: int, group: Any,
                ignore_index: int) -> torch.Tensor:
        logits = logits.float()
        vmax = logits.max(dim=-1).values
        dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - vmax[:, None]
        valid = targets != ignore_index
        local_t = targets - start
        mine = valid & (local_t >= 0) & (local_t < logits.shape[-1])
        idx = local_t.masked_fill(~mine, 0)
        target_logit = shifted.gather(1, idx[:, None]).squeeze(1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([target_logit, sum_exp])
        dist.all_reduce(both, group=group)
        target_logit, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp, sum_exp, idx, mine, valid)
        return loss.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        exp, sum_exp, idx, mine, valid = ctx.saved_tensors
        g = exp / sum_exp[:, None]  # softmax shard
        g.scatter_add_(1, idx[:, None], -mine.to(g.dtype)[:, None])
        g.mul_(valid.to(g.dtype)[:, None] * grad)
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int, group: Any,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group, ignore_index)


class VocabParallelLMLoss(nn.Module):
    """hidden [B, T, D] -> sum of cross-entropy through the vocabulary-sharded output projection."""

    def __init__(self, model: nn.Module, start: int, group: Any) -> None:
        super().__init__()
        self.start, self.group = start, group
        self._model = [model]  # not a submodule: the projection weight belongs to the model

    def rows(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden -> the [B*T, D] rows every tp rank projects onto its vocabulary shard (f: identity forward,
        all-reduce backward; sequence parallel gathers the sequence shards instead)."""
        return copy_to_tp(hidden.reshape(-1, hidden.shape[-1]), self.group)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        weight = self._model[0].output_weight
        h = self.rows(hidden, targets)
        return vocab_parallel_cross_entropy(h @ weight.t(), targets.reshape(-1), self.start, self.group)


def tp_param_names(model: nn.Module) -> set[str]:
    """Names of parameters split across the tensor-parallel group (the rest is replicated)."""
    out = set()
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(mod, nn.Linear) and getattr(mod, "tp_slice", None) is not None:
            out.add(prefix + "weight")  # a row-parallel bias and the q/k norms are replicated
            if mod.bias is not None and mod.tp_slice[0] == 0:
                out.add(prefix + "bias")
        elif isinstance(mod, VocabParallelEmbedding):
            out.add(prefix + "weight")
    if getattr(model, "lm_head", None) is not None and getattr(model, "lm_loss", None) is not None:
        out.add("lm_head.weight")
    return out


def tp_shard_dims(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Sharded parameter name -> (the dim it is split on, that dim's full size), from the modules' `tp_slice`:
    what a checkpoint needs to record each slice's place in the full tensor (`seqtrain.engine.tensor`)."""
    out = {}
    for name, mod in model.named_modules():
        sl = getattr(mod, "tp_slice", None)
        if sl is not None and isinstance(getattr(mod, "weight", None), torch.Tensor):
            out[f"{name}.weight" if name else "weight"] = (int(sl[0]), int(sl[2]))
            if sl[0] == 0 and isinstance(getattr(mod, "bias", None), torch.Tensor):  # a column-parallel bias
                out[f"{name}.bias" if name else "bias"] = (0, int(sl[2]))
    return out


def apply_tensor_parallel(model: nn.Module, rank: int, size: int, group: Any) -> nn.Module:
    """Shard a GPT in place: heads and MLP hidden units per rank, vocabulary rows per rank. Returns the model,
    which now also has `lm_loss(hidden, targets)` (vocabulary-parallel cross-entropy sum)."""
    if size == 1:
        return model
    if not hasattr(model, "blocks"):
        raise ValueError("tensor parallel applies to GPT models (model.blocks)")
    for block in model.blocks:
        attn = block.attn
        if attn.heads % size or attn.kv_heads % size:
            raise ValueError(f"heads {attn.heads} / kv heads {attn.kv_heads} not divisible by tensor parallel {size}")
        for lin in (attn.q, attn.k, attn.v):
            _shard_rows(lin, rank, size)
        _shard_cols(attn.out, rank, size)
        attn.heads //= size
        attn.kv_heads //= size
        attn.__class__ = TPAttention
        attn.group = group
        if attn.qk_norm:
            for norm in (attn.q_norm, attn.k_norm):
                norm.__class__ = TPHeadNorm
                norm.group = group
        mlp = block.mlp
        if isinstance(mlp, SwiGLU):
            _shard_rows(mlp.gate, rank, size)
        _shard_rows(mlp.up, rank, size)
        _shard_cols(mlp.down, rank, size)
        mlp.__class__ = TPSwiGLU if isinstance(mlp, SwiGLU) else TPGeluMLP
        mlp.group = group
    vocab = model.embed.num_embeddings
    if vocab % size:
        raise ValueError(f"vocabulary {vocab} not divisible by tensor parallel {size}")
    model.embed = VocabParallelEmbedding(model.embed, rank, size, group)
    if model.lm_head is not None:
        _shard_rows(model.lm_head, rank, size)
    model.lm_loss = VocabParallelLMLoss(model, model.embed.start, group)
    return model
