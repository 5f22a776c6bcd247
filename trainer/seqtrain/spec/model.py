"""`spec.model`: which architecture and how big."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from seqtrain.spec.base import MAX_SEQ_LEN, SpecModel

Arch = Literal["gpt", "lstm", "gru", "qrnn"]

# LoRA targets per arch: GPT and QRNN linear layers by their module name; LSTM/GRU weight matrices by parameter.
LORA_TARGETS = {
    "gpt": ("q", "k", "v", "out", "gate", "up", "down"),
    "lstm": ("weight_ih", "weight_hh"),
    "gru": ("weight_ih", "weight_hh"),
    "qrnn": ("proj",),
}
LORA_DEFAULT_TARGETS = {"gpt": ("q", "k", "v", "out"), "lstm": ("weight_ih", "weight_hh"),
                        "gru": ("weight_ih", "weight_hh"), "qrnn": ("proj",)}


class LoraSpec(SpecModel):
    """Low-rank adapters (Hu et al. 2021): W x + (alpha / rank) B A x, only A and B train."""

    rank: int = Field(8, ge=1, le=4096, description="Rank r of the adapters A [r, in] and B [out, r].")
    alpha: float = Field(16.0, gt=0, le=1e6, description="Scale: the update is alpha / rank x B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (linear targets).")
    target_modules: list[str] | None = Field(
        None, description="What gets adapters. gpt: q, k, v, out, gate, up, down (default q, k, v, out); lstm/gru: "
        "weight_ih, weight_hh (default both); qrnn: proj.",
    )

    def targets(self, arch: str) -> tuple[str, ...]:
        return tuple(self.target_modules) if self.target_modules else LORA_DEFAULT_TARGETS[arch]


class ModelSpec(SpecModel):
    """Architecture plus either a size preset or explicit dimensions (explicit values win over the preset)."""

    arch: Arch = Field("gpt", description="Model family: gpt (decoder-only transformer), lstm, gru or qrnn.")
    preset: str | None = Field(
        None, description="Size preset (see `seqtrain.spec.presets`), e.g. tiny, small. Explicit dims override it."
    )
    vocab_size: int | None = Field(
        None, ge=2, le=2**22, description="Vocabulary size; default: the tokenizer's (256 for the byte-level tokenizer)."
    )
    dim: int | None = Field(None, ge=1, le=65536, description="Model width (embedding / hidden size).")
    layers: int | None = Field(None, ge=1, le=1024, description="Number of blocks (transformer) or stacked recurrent layers.")
    heads: int | None = Field(None, ge=1, le=1024, description="Attention heads (gpt only); dim must be divisible by heads.")
    kv_heads: int | None = Field(None, ge=1, le=1024, description="Key/value heads for grouped-query attention (gpt only).")
    ffn_dim: int | None = Field(None, ge=1, le=1_048_576, description="Hidden size of the SwiGLU MLP (gpt only).")
    max_seq_len: int | None = Field(
        None, ge=1, le=MAX_SEQ_LEN, description="Longest sequence the model accepts (RoPE table size for gpt)."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability.")
    tie_embeddings: bool = Field(True, description="Share the input embedding and the output projection.")
    rope_theta: float = Field(10000.0, gt=0, le=1e9, description="RoPE base frequency (gpt only).")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of RMSNorm / LayerNorm.")
    init_std: float = Field(0.02, gt=0, le=10, description="Standard deviation of the normal weight init.")
    lora: LoraSpec | None = Field(
        None, description="Fine-tune with LoRA adapters: the model's own weights stay frozen (usually from "
        "model.init); only the adapters train and are checkpointed.",
    )
    init: str | None = Field(
        None, description="Start from these weights (fine-tuning): a Hugging Face folder of a Llama-shaped model, a "
        "seqtrain export, run folder or checkpoints/step-N folder. Architecture and dims come from the weights; "
        "explicit dims must match them. Resuming from the job's own checkpoints takes precedence.",
    )
