"""Parameter and compute counts per layer, from the model spec alone (no torch).

The planner's memory estimate and the pipeline's stage split both read these numbers, so `seqtrain plan` shows
exactly the split the trainer will use. A unit test checks `ParamBreakdown.total` against the parameters of the
built model, so the formulas cannot drift from the code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from seqtrain.layout.topology import balanced_split

if TYPE_CHECKING:  # annotations only: layout sits below the spec and never imports it
    from seqtrain.spec.model import ModelSpec


@dataclass(frozen=True)
class ParamBreakdown:
    """Parameters by place in the model: embedding -> `blocks` x `block` -> final norm -> output projection."""

    embedding: int
    block: int
    blocks: int
    final: int
    output: int  # 0 when the output projection is tied to the embedding
    # Of `block`: the part split by tensor parallelism (attention/MLP matrices); the rest (norms) is replicated.
    block_tp_split: int = 0

    @property
    def total(self) -> int:
        return self.embedding + self.block * self.blocks + self.final + self.output


def param_breakdown(m: ModelSpec) -> ParamBreakdown:
    """Counts for a resolved model spec (see `seqtrain.spec.resolve`)."""
    assert m.dim and m.layers and m.vocab_size, "resolve the model spec first (seqtrain.spec.resolve)"
    d, v = m.dim, m.vocab_size
    emb = v * d
    out = 0 if m.tie_embeddings else v * d
    if m.arch == "gpt":
        assert m.heads and m.kv_heads and m.ffn_dim
        hd = m.head_dim or d // m.heads
        q, kv = m.heads * hd, m.kv_heads * hd
        attn = d * q + 2 * d * kv + q * d  # wq, wk, wv, wo
        attn += (q + 2 * kv) * m.qkv_bias + d * m.out_bias
        matrices = 3 if m.mlp == "swiglu" else 2  # SwiGLU: gate, up, down; GELU: up, down
        mlp = matrices * d * m.ffn_dim + ((matrices - 1) * m.ffn_dim + d) * m.mlp_bias
        per_norm = 2 * d if m.has_norm_bias else d  # weight, and a bias (LayerNorm unless normBias false)
        norms = 2 * per_norm + 2 * hd * m.qk_norm  # before attention and MLP; q/k norms
        emb += (m.max_seq_len or 0) * d if m.positions == "learned" else 0
        return ParamBreakdown(emb, attn + mlp + norms, m.layers, per_norm, out, block_tp_split=attn + mlp)
    if m.arch == "qrnn":
        block = 3 * d * (2 * d + 1)  # one Linear [x_t; x_{t-1}] (2d) -> z, f, o (3d), with bias
    else:
        # torch.nn.LSTM/GRU layer: W_ih [g*d, d], W_hh [g*d, d], b_ih, b_hh [g*d]
        block = {"lstm": 4, "gru": 3}[m.arch] * d * (2 * d + 2)
    return ParamBreakdown(emb, block, m.layers, d, out)  # final RMSNorm weight


@dataclass(frozen=True)
class FlopBreakdown:
    """Forward multiply-adds x 2 per token."""

    embedding: float
    block: float
    head: float


def flops_per_token(m: ModelSpec, seq_len: int) -> FlopBreakdown:
    p = param_breakdown(m)
    if m.arch == "gpt":
        # matmuls: 2 flops per weight; attention scores and weighted sum: 2 * 2 * seq * dim (causal halves it).
        block = 2.0 * p.block_tp_split + 2.0 * seq_len * (m.dim or 0)
    else:
        block = 2.0 * p.block
    head = 2.0 * (m.vocab_size or 0) * (m.dim or 0)
    return FlopBreakdown(embedding=0.0, block=block, head=head)


def stage_bounds(m: ModelSpec, stages: int, seq_len: int) -> list[tuple[int, int]]:
    """Which blocks each pipeline stage holds: [start, end) per stage, balanced by forward compute.

    The embedding always rides with the first block and the output head with the last, so their cost is added
    to those blocks before the split (an LM head of vocab x dim easily weighs as much as a small block).
    """
    assert m.layers
    if stages == 1:
        return [(0, m.layers)]
    f = flops_per_token(m, seq_len)
    costs = [f.block] * m.layers
    costs[0] += f.embedding
    costs[-1] += f.head
    return balanced_split(costs, stages)
