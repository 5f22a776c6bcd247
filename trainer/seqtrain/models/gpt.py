"""GPT-style decoder: token embedding -> blocks (norm, attention, norm, MLP) -> final norm.

The block's switches (`model.norm`, `normBias`, `mlp`, `positions`, `ropeScaling`, biases, `qkNorm`, `headDim`,
`slidingWindow`) cover the Llama, Mistral, Qwen2/3 and GPT-2 families and nanoGPT's model; their defaults are the
Llama-shaped block (RMSNorm, RoPE attention without biases, SwiGLU MLP).

`forward` returns hidden states; the output projection (`output_weight`) is applied by the loss, so a fused
linear + cross-entropy kernel never materialises the logits. Blocks live in `self.blocks` (an nn.ModuleList)
because pipeline stages, activation checkpointing and tensor parallelism are applied per block.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from seqtrain.models import layers
from seqtrain.models.layers import (
    CausalSelfAttention,
    GeluMLP,
    SwiGLU,
    document_positions,
    make_norm,
    rope_tables,
    window_applies,
)
from seqtrain.runtime.shards import full_shape, holds_memory, write_local
from seqtrain.spec.model import ModelSpec


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        assert spec.dim and spec.heads and spec.kv_heads and spec.ffn_dim
        self.attn_norm = make_norm(spec.norm, spec.dim, spec.norm_eps, spec.norm_bias)
        self.attn = CausalSelfAttention(
            spec.dim, spec.heads, spec.kv_heads, spec.head_size, qkv_bias=spec.qkv_bias, out_bias=spec.out_bias,
            qk_norm=spec.qk_norm, norm_eps=spec.norm_eps, rope=spec.positions == "rope", window=spec.sliding_window)
        self.mlp_norm = make_norm(spec.norm, spec.dim, spec.norm_eps, spec.norm_bias)
        self.mlp: GeluMLP | SwiGLU
        if spec.mlp == "swiglu":
            self.mlp = SwiGLU(spec.dim, spec.ffn_dim, bias=spec.mlp_bias)
        else:  # gelu: the tanh approximation (GPT-2's gelu_new); gelu-exact: erf (nanoGPT's nn.GELU())
            self.mlp = GeluMLP(spec.dim, spec.ffn_dim, bias=spec.mlp_bias,
                               approximate="tanh" if spec.mlp == "gelu" else "none")
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
        # model.padVocabTo: rows beyond the vocabulary (zero, never a token; the loss masks them)
        self.vocab_size = spec.vocab_size
        rows = spec.padded_vocab_size
        self.embed = nn.Embedding(rows, spec.dim)
        # learned positions (GPT-2): one row per position, added to the token embedding
        self.pos_embed = nn.Embedding(spec.max_seq_len, spec.dim) if spec.positions == "learned" else None
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = make_norm(spec.norm, spec.dim, spec.norm_eps, spec.norm_bias)
        self.lm_head = None if spec.tie_embeddings else nn.Linear(spec.dim, rows, bias=False)
        cos, sin = self._rope_tables()
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
            if len(shape) < 2:  # norm scales start at 1, biases at 0 (no draw)
                if holds_memory(p):
                    write_local(p, torch.zeros(shape) if name.endswith(".bias") else torch.ones(shape))
                continue
            owner, _, attr = name.rpartition(".")
            # (dim, start, full size) of a tensor-parallel weight, kept on its module (to_empty swaps Parameters)
            sl = getattr(self.get_submodule(owner), "tp_slice", None) if attr == "weight" else None
            if sl is not None:
                shape[sl[0]] = sl[2]
            # vocabulary padding: the real rows drawn as without padding, the pad rows zero
            pad = shape[0] - self.vocab_size if name in ("embed.weight", "lm_head.weight") else 0
            full = torch.empty([shape[0] - pad, *shape[1:]]).normal_(
                0.0, out_std if name.endswith(("attn.out.weight", "mlp.down.weight")) else std, generator=g)
            if pad:
                full = torch.cat([full, full.new_zeros(pad, *shape[1:])])
            if not holds_memory(p):
                continue
            if sl is not None:
                full = full.narrow(sl[0], sl[1], p.shape[sl[0]])
            write_local(p, full)  # this rank's data-parallel shard of it, or all of it
        dev = buffer_device or self.rope_cos.device  # every stage needs the tables: materialise them here
        if dev.type != "meta":
            cos, sin = self._rope_tables()
            self.rope_cos, self.rope_sin = cos.to(dev), sin.to(dev)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        assert s.max_seq_len
        return rope_tables(s.max_seq_len, s.head_size, s.rope_theta, s.rope_scaling, s.max_seq_len)

    @property
    def output_weight(self) -> torch.Tensor:
        """The [vocab, dim] output projection (the embedding itself when tied); with model.padVocabTo its rows
        from `vocab_size` on are padding (the loss masks them)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> hidden [B, T, D]. With doc_ids [B, T] (packing) documents never attend to each
        other and RoPE positions restart at each document."""
        t = tokens.shape[1]
        if t > self.rope_cos.shape[0]:
            raise ValueError(f"sequence of {t} tokens is longer than model.maxSeqLen {self.rope_cos.shape[0]}")
        pos = None
        if doc_ids is None:
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        else:
            pos = document_positions(doc_ids)
            cos, sin = self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]  # [B, 1, T, Dh/2]
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(t, device=tokens.device) if pos is None else pos)
        x = self.drop(x)
        # The flex_attention mask of packed documents, built once per batch here, outside the (compiled) blocks.
        block_mask = None
        window = self.spec.sliding_window if window_applies(self.spec.sliding_window, t) else None
        if doc_ids is not None and layers.use_flex(x) and (not self.blocks[0].attn.use_kernels or window):
            block_mask = layers.doc_block_mask(doc_ids, causal=True, window=window)
        for block in self.blocks:
            x = block(x, cos, sin, doc_ids, block_mask)
        return self.norm(x)
