"""`spec.model`: which architecture and how big."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from seqtrain.spec.base import MAX_SEQ_LEN, SpecModel

Arch = Literal["gpt", "lstm", "gru", "qrnn"]
Norm = Literal["rmsnorm", "layernorm"]
Mlp = Literal["swiglu", "gelu", "gelu-exact"]
Positions = Literal["rope", "learned"]
RopeType = Literal["llama3", "linear", "yarn"]

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


class RopeScaling(SpecModel):
    """RoPE frequency scaling for contexts longer than the model was trained on, as transformers defines it
    (`modeling_rope_utils`): `linear` divides every frequency by `factor`; `llama3` divides only the low frequencies
    (wavelengths above originalMaxSeqLen / lowFreqFactor) and blends the band up to originalMaxSeqLen /
    highFreqFactor; `yarn` blends interpolation and extrapolation per dimension (betaFast/betaSlow) and scales
    cos/sin by attentionFactor (default 0.1 ln(factor) + 1)."""

    type: RopeType = Field(..., description="llama3, linear or yarn.")
    factor: float = Field(..., gt=0, le=1e6, description="How many times longer than originalMaxSeqLen.")
    original_max_seq_len: int | None = Field(
        None, ge=1, le=MAX_SEQ_LEN, description="Context the model was pretrained with (llama3 and yarn; "
        "transformers' original_max_position_embeddings); default maxSeqLen, as transformers defaults it.",
    )
    low_freq_factor: float = Field(1.0, gt=0, le=1e6, description="llama3: wavelengths above originalMaxSeqLen / "
                                   "lowFreqFactor are divided by factor.")
    high_freq_factor: float = Field(4.0, gt=0, le=1e6, description="llama3: wavelengths below originalMaxSeqLen / "
                                    "highFreqFactor are kept.")
    beta_fast: float = Field(32.0, gt=0, le=1e6, description="yarn: rotations at which extrapolation starts.")
    beta_slow: float = Field(1.0, gt=0, le=1e6, description="yarn: rotations at which interpolation ends.")
    attention_factor: float | None = Field(None, gt=0, le=1e6, description="yarn: scale of cos/sin; default "
                                           "0.1 ln(factor) + 1 (or from mscale / mscaleAllDim).")
    mscale: float | None = Field(None, ge=0, le=1e6, description="yarn: DeepSeek-style mscale (with mscaleAllDim).")
    mscale_all_dim: float | None = Field(None, ge=0, le=1e6, description="yarn: DeepSeek-style mscale_all_dim.")
    truncate: bool = Field(True, description="yarn: round the correction range to whole dimensions.")


class ModelSpec(SpecModel):
    """Architecture plus either a size preset or explicit dimensions (explicit values win over the preset)."""

    arch: Arch = Field("gpt", description="Model family: gpt (decoder-only transformer), lstm, gru or qrnn.")
    preset: str | None = Field(
        None, description="Size preset (see `seqtrain.spec.presets`), e.g. tiny, small. Explicit dims override it."
    )
    vocab_size: int | None = Field(
        None, ge=2, le=2**22, description="Vocabulary size; default: the tokenizer's (256 for the byte-level tokenizer)."
    )
    pad_vocab_to: int = Field(
        1, ge=1, le=4096, description="Round the embedding and output rows up to a multiple of this (gpt only): "
        "GPU matmuls prefer 64 or 128 (llm.c pads GPT-2's 50257 to 50304). The pad rows are never a token: their "
        "logits are -inf in the loss, and export and generate drop them. 1: no padding.",
    )
    dim: int | None = Field(None, ge=1, le=65536, description="Model width (embedding / hidden size).")
    layers: int | None = Field(None, ge=1, le=1024, description="Number of blocks (transformer) or stacked recurrent layers.")
    heads: int | None = Field(None, ge=1, le=1024, description="Attention heads (gpt only); dim must be divisible by heads.")
    kv_heads: int | None = Field(None, ge=1, le=1024, description="Key/value heads for grouped-query attention (gpt only).")
    ffn_dim: int | None = Field(None, ge=1, le=1_048_576, description="Hidden size of the MLP (gpt only).")
    head_dim: int | None = Field(
        None, ge=1, le=65536, description="Width of one attention head (gpt only); default dim / heads. Qwen3 and "
        "some Mistral models set it explicitly, so heads x headDim may differ from dim.",
    )
    norm: Norm = Field("rmsnorm", description="Normalisation of the block inputs and the output (gpt only): "
                       "rmsnorm (Llama, Qwen, Mistral) or layernorm, with a bias unless normBias is false (GPT-2).")
    norm_bias: bool | None = Field(
        None, description="Bias of the norms (gpt only); default: the norm's own, layernorm has one, rmsnorm none. "
        "false with layernorm: nanoGPT's LayerNorm(bias=False), its train.py default.",
    )
    mlp: Mlp = Field("swiglu", description="The block's MLP (gpt only): swiglu, down(silu(gate(x)) * up(x)); "
                     "gelu, down(gelu(up(x))) with GELU's tanh approximation (GPT-2's gelu_new); or gelu-exact, "
                     "the same with the exact (erf) GELU (nanoGPT's nn.GELU(), transformers' activation_function "
                     "gelu).")
    positions: Positions = Field("rope", description="Position information (gpt only): rope (rotary, in every "
                                 "attention) or learned (an embedding of maxSeqLen positions added to the tokens', "
                                 "GPT-2).")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE frequency scaling (positions rope); none by "
                                             "default.")
    qkv_bias: bool = Field(False, description="Biases on the q, k and v projections (Qwen2, GPT-2).")
    out_bias: bool = Field(False, description="Bias on the attention output projection (GPT-2).")
    mlp_bias: bool = Field(False, description="Biases on the MLP projections (GPT-2).")
    qk_norm: bool = Field(False, description="RMSNorm over the head dimension of q and k before RoPE (Qwen3).")
    sliding_window: int | None = Field(
        None, ge=1, le=MAX_SEQ_LEN, description="Each position attends to at most this many positions, itself "
        "included (Mistral); none: the whole causal context.",
    )
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
        None, description="Start from these weights (fine-tuning): a Hugging Face model folder (Llama, Mistral, "
        "Qwen2, Qwen3 or GPT-2) or hf://ORG/NAME[@REVISION] from the local Hugging Face cache, a seqtrain export, "
        "run folder or checkpoints/step-N folder. Architecture, dims and "
        "block switches come from the weights; explicit values must match them. The folder's tokenizer.json is the "
        "job's tokenizer unless data.tokenizer names another. Resuming from the job's own checkpoints takes "
        "precedence.",
    )
    hub_token_secret: str | None = Field(
        None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description="model.init hf:// on Kubernetes: a Secret of the job's namespace (key `token`) with the "
        "Hugging Face token; read only by the download init container (as HF_TOKEN); the pod policy's Secret "
        "allowlist (podPolicy.secrets) must list it.",
    )

    @model_validator(mode="after")
    def _hub_token_needs_hf(self) -> ModelSpec:
        if self.hub_token_secret and not (self.init or "").startswith("hf://"):
            raise ValueError("hubTokenSecret is for model.init hf://ORG/NAME (the init container's download); "
                             "remove it or set model.init to an hf:// model")
        return self

    @property
    def has_norm_bias(self) -> bool:
        """Whether the norms have a bias: normBias, else the norm's own default (layernorm yes, rmsnorm no)."""
        return self.norm_bias if self.norm_bias is not None else self.norm == "layernorm"

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the output projection: vocabSize rounded up to a multiple of padVocabTo."""
        assert self.vocab_size, "resolve() the spec"
        return -(-self.vocab_size // self.pad_vocab_to) * self.pad_vocab_to

    @property
    def head_size(self) -> int:
        """Width of one attention head: headDim, or dim / heads (a resolved gpt spec)."""
        assert self.dim and self.heads, "resolve() the spec"
        return self.head_dim or self.dim // self.heads


# The block switches a GPT has beyond its dims (snake_case), each with the value that keeps the plain block.
GPT_SWITCHES = {"norm": "rmsnorm", "norm_bias": None, "mlp": "swiglu", "positions": "rope", "qkv_bias": False,
                "out_bias": False, "mlp_bias": False, "qk_norm": False, "head_dim": None, "rope_scaling": None,
                "sliding_window": None}


def layout_problems(m: ModelSpec, tensor_parallel: int, pipeline_parallel: int,
                    sequence_parallel: bool) -> list[tuple[str, str]]:
    """(field, message) for each GPT block switch that a parallel layout cannot honour yet, or that the block
    cannot honour at all (normBias true with rmsnorm, ropeScaling with learned positions)."""
    if m.arch != "gpt":
        return [(f"spec.model.{alias}", f"only applies to arch gpt, not {m.arch}; remove it")
                for name, alias in (("norm", "norm"), ("norm_bias", "normBias"), ("mlp", "mlp"),
                                    ("positions", "positions"), ("qkv_bias", "qkvBias"), ("out_bias", "outBias"),
                                    ("mlp_bias", "mlpBias"),
                                    ("qk_norm", "qkNorm"), ("head_dim", "headDim"), ("rope_scaling", "ropeScaling"),
                                    ("sliding_window", "slidingWindow"))
                if getattr(m, name) != GPT_SWITCHES[name]] + (
                    [("spec.model.padVocabTo", f"only applies to arch gpt, not {m.arch}; remove it")]
                    if m.pad_vocab_to != 1 else [])
    out = []
    if m.norm == "rmsnorm" and m.norm_bias:
        out.append(("spec.model.normBias", "true needs norm layernorm (RMSNorm has no bias); remove normBias, or "
                    "set model.norm: layernorm"))
    if m.pad_vocab_to > 1 and (tensor_parallel > 1 or pipeline_parallel > 1):
        which = "tensorParallel" if tensor_parallel > 1 else "pipelineParallel"
        out.append(("spec.model.padVocabTo", f"vocabulary padding is not supported with {which} > 1 yet (its "
                    f"vocabulary-parallel loss would see the pad rows); use padVocabTo: 1, or {which}: 1"))
    if m.positions == "learned" and m.rope_scaling is not None:
        out.append(("spec.model.ropeScaling", "applies to positions rope; remove it with positions learned"))
    if sequence_parallel and tensor_parallel > 1:
        why = "sequence parallel shards the sequence between tensor-parallel ranks"
        for name, alias, bad, fix in (
                ("norm", "norm", m.norm == "layernorm", "rmsnorm"), ("mlp", "mlp", m.mlp != "swiglu", "swiglu"),
                ("positions", "positions", m.positions == "learned", "rope"),
                ("qkv_bias", "qkvBias", m.qkv_bias, "false"), ("out_bias", "outBias", m.out_bias, "false"),
                ("mlp_bias", "mlpBias", m.mlp_bias, "false")):
            if bad:
                out.append((f"spec.model.{alias}", f"{getattr(m, name)} is not supported with sequenceParallel "
                            f"({why}); use {fix}, or optimization.sequenceParallel: false"))
    if pipeline_parallel > 1 and m.positions == "learned":
        out.append(("spec.model.positions", "learned is not supported with pipelineParallel > 1 (the first stage "
                    "adds only the token embedding); use rope, or pipelineParallel: 1"))
    return out
