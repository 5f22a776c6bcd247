"""Model FLOPs per token from the architecture's dimensions (no model needed: the planner can use it too).

Conventions (PaLM appendix B, Megatron-LM, torchtitan), documented in docs/user-guide.md:

* Only matrix multiplications count (2 FLOPs per multiply-add). Norms, activations, RoPE, softmax and the
  embedding lookup are left out: they are a few percent at most and not what tensor cores are rated for.
* Training = forward + backward = 3 x forward (backward computes the gradients of activations and weights).
* GPT, per token with context T, width D, L blocks, Dkv = kv_heads * head_dim, SwiGLU hidden F, vocabulary V:
      forward = 2 * [L * (2 D^2 + 2 D Dkv + 3 D F) + D V]  +  4 * L * T * D
  so training = 6 N + 12 L T D, N being the matmul parameters (the "6N + 12 L H Q T" of PaLM with H Q = D).
  The attention term counts the full T x T score matrix, as the convention does; causal masking lets a
  flash kernel skip about half of it, which MFU then does not reward.
* LSTM / GRU layer with input size I and hidden size H: 4 (LSTM) or 3 (GRU) gates, each an I x H and an
  H x H matmul: forward = 2 * g * H * (I + H) per token.
* QRNN layer (Bradbury et al. 2017): the z, f, o gates come from a convolution of width k over time: forward
  = 2 * 3 * k * I * H; the recurrence itself is elementwise.
* Hardware FLOPs (HFU) add the forward FLOPs that activation checkpointing recomputes in backward
  (`recomputed_flops`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from seqtrain.spec.model import ModelSpec

# QRNN convolution width over time; the model uses the same constant (window 2 as in the QRNN LM paper).
QRNN_WINDOW = 2

_RNN_GATES = {"lstm": 4, "gru": 3}


@dataclass(frozen=True)
class TokenFlops:
    """Forward FLOPs for one token, split by what activation checkpointing can recompute."""

    layers_dense: float  # matmuls inside the blocks / recurrent layers
    layers_attention: float  # T-dependent attention matmuls (0 for recurrent models)
    head: float  # output projection

    @property
    def forward(self) -> float:
        return self.layers_dense + self.layers_attention + self.head

    @property
    def training(self) -> float:
        """Model FLOPs per trained token: forward + backward (the MFU numerator)."""
        return 3.0 * self.forward

    def hardware(self, recomputed: float) -> float:
        """FLOPs actually executed per token when activation checkpointing recomputes `recomputed` forward
        FLOPs per token in backward (see `recomputed_flops`)."""
        return self.training + recomputed


def token_flops(spec: ModelSpec, seq_len: int) -> TokenFlops:
    """Forward FLOPs per token of a resolved model spec (see `seqtrain.spec.resolve`) at context `seq_len`."""
    if spec.dim is None or spec.layers is None or spec.vocab_size is None:
        raise ValueError("model spec is not resolved: call seqtrain.spec.resolve(job) first")
    d, n_layers, v = spec.dim, spec.layers, spec.vocab_size
    head = 2.0 * d * v
    if spec.arch == "gpt":
        if not (spec.heads and spec.kv_heads and spec.ffn_dim):
            raise ValueError("gpt spec needs heads, kv_heads and ffn_dim (call seqtrain.spec.resolve)")
        d_kv = spec.kv_heads * (d // spec.heads)
        d_q = spec.heads * (d // spec.heads)
        per_layer = 2.0 * (d * d_q + 2 * d * d_kv + d_q * d + 3 * d * spec.ffn_dim)
        # QK^T and scores x V: each 2 * T * d_q per token
        attention = 4.0 * seq_len * d_q
        return TokenFlops(n_layers * per_layer, n_layers * attention, head)
    if spec.arch in _RNN_GATES:
        per_layer = 2.0 * _RNN_GATES[spec.arch] * d * (d + d)
        return TokenFlops(n_layers * per_layer, 0.0, head)
    if spec.arch == "qrnn":
        per_layer = 2.0 * 3 * QRNN_WINDOW * d * d
        return TokenFlops(n_layers * per_layer, 0.0, head)
    raise ValueError(f"spec.model.arch: no FLOP formula for {spec.arch!r}")


def recomputed_flops(spec: ModelSpec, seq_len: int, policy: str, every: int = 2) -> float:
    """Forward FLOPs per token that an activation-checkpointing policy runs again in backward.

    Mirrors `seqtrain.models.activation_checkpointing`: full checkpoints every block; every checkpoints the blocks with
    index % k == 0; sqrt checkpoints about sqrt(L) consecutive segments covering all blocks; selective
    checkpoints each block's attention and MLP modules (only norms keep their outputs). torch's non-reentrant
    checkpoint stops recomputing once the tensors backward needs are back, so the last matmul of each
    checkpointed region (the MLP down projection; for selective also the attention output projection) is not
    redone. Recurrent models checkpoint time chunks of the whole layer stack under any policy but none.
    """
    if policy == "none":
        return 0.0
    f = token_flops(spec, seq_len)
    if spec.arch != "gpt":
        return f.layers_dense + f.layers_attention
    n_layers = spec.layers or 0
    layer = (f.layers_dense + f.layers_attention) / n_layers
    assert spec.dim and spec.ffn_dim and spec.heads
    down = 2.0 * spec.ffn_dim * spec.dim
    out_proj = 2.0 * spec.heads * (spec.dim // spec.heads) * spec.dim
    if policy == "full":
        return n_layers * (layer - down)
    if policy == "every":
        return len(range(0, n_layers, max(1, every))) * (layer - down)
    if policy == "sqrt":
        n_seg = max(1, round(math.sqrt(n_layers)))
        size = math.ceil(n_layers / n_seg)
        return n_layers * layer - len(range(0, n_layers, size)) * down
    if policy == "selective":
        return n_layers * (layer - down - out_proj)
    raise ValueError(f"spec.optimization.activationCheckpointing.policy: unknown policy {policy!r}")
