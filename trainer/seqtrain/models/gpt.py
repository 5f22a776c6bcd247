"""GPT-style decoder: token embedding -> blocks (RMSNorm, RoPE attention, SwiGLU MLP) -> final RMSNorm.

`forward` returns hidden states; the output projection (`output_weight`) is applied by the loss, so a fused
linear + cross-entropy kernel never materialises the logits. Blocks live in `self.blocks` (an nn.ModuleList)
because pipeline stages, activation checkpointing and tensor parallelism are applied per block.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from seqtrain.models import layers
from seqtrain.models.layers import CausalSelfAttention, RMSNorm, SwiGLU, document_positions, rope_tables
from seqtrain.runtime.shards import full_shape, holds_memory, write_local
from seqtrain.spec.model import ModelSpec


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
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc_ids: torch.Tensor | None = None,
        block_mask: object | None = None,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), cos, sin, doc_ids, block_mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    """Built on the current device; under `with torch.device("meta")` nothing is allocated and
    `init_weights` later fills whatever part was materialised (`seqtrain.models.materialize`)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        assert spec.vocab_size and spec.dim and spec.layers and spec.heads and spec.max_seq_len, "resolve() the spec"
        self.spec = spec
        # One draw from the global CPU generator, before any submodule exists: the initial weights depend only on
        # the seed, never on the device, on what the constructors drew, or on which part a rank materialises.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.embed = nn.Embedding(spec.vocab_size, spec.dim)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.dim, spec.norm_eps)
        self.lm_head = None if spec.tie_embeddings else nn.Linear(spec.dim, spec.vocab_size, bias=False)
        cos, sin = rope_tables(spec.max_seq_len, spec.dim // spec.heads, spec.rope_theta)
        # Not persistent: derived from the spec, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # On meta, or partitioned by DeepSpeed's zero.Init (ds_id) under its patched constructors: the caller
        # initialises once the parameters are materialised / outside that context.
        if self.embed.weight.device.type != "meta" and not hasattr(self.embed.weight, "ds_id"):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter that is not on the meta device, and the RoPE tables.

        Each matrix is drawn whole on the CPU from a generator seeded with `init_seed`, in parameter order, and
        the local part is copied in: a tensor-parallel slice (a module's `tp_slice`, set by `seqtrain.parallel.tensor`)
        or nothing for a part another rank holds (pipeline); of a parameter sharded before it was materialised
        (FSDP2, ZeRO-3) only this rank's shard (`seqtrain.runtime.shards`). So every layout starts from exactly the weights of
        the single process, and a rank's device never holds more than its own parameters (the host holds one
        full matrix at a time). GPT-2 style: residual output projections scaled down by depth.
        """
        std = self.spec.init_std
        out_std = std / math.sqrt(2 * len(self.blocks))
        g = torch.Generator().manual_seed(self.init_seed)
        for name, p in self.named_parameters():
            shape = list(full_shape(p))  # the global shape of a sharded (FSDP2 / ZeRO-3) parameter
            if len(shape) < 2:  # norm scales start at 1 (no draw)
                if holds_memory(p):
                    write_local(p, torch.ones(shape))
                continue
            owner, _, attr = name.rpartition(".")
            # (dim, start, full size) of a tensor-parallel weight, kept on its module (to_empty swaps Parameters)
            sl = getattr(self.get_submodule(owner), "tp_slice", None) if attr == "weight" else None
            if sl is not None:
                shape[sl[0]] = sl[2]
            full = torch.empty(shape).normal_(0.0, out_std if name.endswith(("attn.out.weight", "mlp.down.weight"))
                                              else std, generator=g)
            if not holds_memory(p):
                continue
            if sl is not None:
                full = full.narrow(sl[0], sl[1], p.shape[sl[0]])
            write_local(p, full)  # this rank's data-parallel shard of it, or all of it
        dev = buffer_device or self.rope_cos.device  # every stage needs the tables: materialise them here
        if dev.type != "meta":
            cos, sin = rope_tables(self.spec.max_seq_len, self.spec.dim // self.spec.heads, self.spec.rope_theta)
            self.rope_cos, self.rope_sin = cos.to(dev), sin.to(dev)

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
        # The flex_attention mask of packed documents, built once per batch here, outside the (compiled) blocks.
        block_mask = None
        if doc_ids is not None and layers.use_flex(x) and not self.blocks[0].attn.use_kernels:
            block_mask = layers.doc_block_mask(doc_ids, causal=True)
        for block in self.blocks:
            x = block(x, cos, sin, doc_ids, block_mask)
        return self.norm(x)
