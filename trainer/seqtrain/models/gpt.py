"""GPT-style decoder: token embedding -> blocks (RMSNorm, RoPE attention, SwiGLU MLP) -> final RMSNorm.

`forward` returns hidden states; the output projection (`output_weight`) is applied by the loss, so a fused
linear + cross-entropy kernel never materialises the logits. Blocks live in `self.blocks` (an nn.ModuleList)
because pipeline stages, activation checkpointing and tensor parallelism are applied per block.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from seqtrain.spec.model import ModelSpec

from .layers import CausalSelfAttention, RMSNorm, SwiGLU, document_positions, rope_tables


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        assert spec.dim and spec.heads and spec.kv_heads and spec.ffn_dim
        self.attn_norm = RMSNorm(spec.dim, spec.norm_eps)
        self.attn = CausalSelfAttention(spec.dim, spec.heads, spec.kv_heads)
        self.mlp_norm = RMSNorm(spec.dim, spec.norm_eps)
        self.mlp = SwiGLU(spec.dim, spec.ffn_dim)
        self.dropout = nn.Dropout(spec.dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), cos, sin, doc_ids))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        assert spec.vocab_size and spec.dim and spec.layers and spec.heads and spec.max_seq_len, "resolve() the spec"
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.dim)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.dim, spec.norm_eps)
        self.lm_head = None if spec.tie_embeddings else nn.Linear(spec.dim, spec.vocab_size, bias=False)
        cos, sin = rope_tables(spec.max_seq_len, spec.dim // spec.heads, spec.rope_theta)
        # Not persistent: derived from the spec, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.spec.init_std
        # GPT-2 style: residual output projections scaled down by depth so the residual stream stays O(1).
        out_std = std / math.sqrt(2 * len(self.blocks))
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm scales stay at 1
            torch.nn.init.normal_(p, 0.0, out_std if name.endswith(("attn.out.weight", "mlp.down.weight")) else std)

    @property
    def output_weight(self) -> torch.Tensor:
        """The [vocab, dim] output projection (the embedding itself when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> hidden [B, T, D]. With doc_ids [B, T] (packing) documents never attend to each
        other and RoPE positions restart at each document."""
        t = tokens.shape[1]
        if t > self.rope_cos.shape[0]:
            raise ValueError(f"sequence of {t} tokens is longer than model.maxSeqLen {self.rope_cos.shape[0]}")
        if doc_ids is None:
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        else:
            pos = document_positions(doc_ids)
            cos, sin = self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]  # [B, 1, T, Dh/2]
        x = self.drop(self.embed(tokens))
        for block in self.blocks:
            x = block(x, cos, sin, doc_ids)
        return self.norm(x)
