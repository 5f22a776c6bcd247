"""seqtrain GPT <-> Hugging Face model folders: config.json and tensor names (torch-free).

One seqtrain GPT block covers five transformers families; each maps onto the block's switches:

| model_type | norm      | mlp    | positions        | biases                          | other                      |
|------------|-----------|--------|------------------|---------------------------------|----------------------------|
| llama      | rmsnorm   | swiglu | rope (+ scaling) | attention_bias: q/k/v/o; mlp_bias | head_dim                 |
| mistral    | rmsnorm   | swiglu | rope             | none                            | head_dim, sliding_window   |
| qwen2      | rmsnorm   | swiglu | rope (+ scaling) | q/k/v                           |                            |
| qwen3      | rmsnorm   | swiglu | rope (+ scaling) | attention_bias: q/k/v/o         | q/k RMSNorm, head_dim      |
| gpt2       | layernorm | gelu   | learned          | all (Conv1D layers, fused qkv)  | tied output                |

GPT-2's `activation_function` is `gelu_new` (or another tanh form: `mlp: gelu`) or `gelu`, the exact erf GELU
(`mlp: gelu-exact`, nanoGPT's `nn.GELU()`). GPT-2's LayerNorms always have a bias: `normBias: false` (nanoGPT's
`bias=False`) has no transformers family and exports with `--format seqtrain` only.

The Llama-style families need no tensor surgery: seqtrain's RoPE rotates the two halves of each head (exactly
transformers' `rotate_half`), grouped kv head j serves query heads j*rep .. (j+1)*rep-1 (`repeat_kv`), so the
mapping is a renaming. GPT-2's Conv1D weights are stored [in, out] and q/k/v are one matrix: `seqtrain.export.
hf_tensors` transposes and splits them. Anything a config says that the block cannot compute is refused with the
exact key (`config.json: rope_scaling.rope_type 'dynamic' is not supported; supported: llama3, linear, yarn`).
"""

from __future__ import annotations

import re
from typing import Any

from seqtrain.spec.model import ModelSpec, RopeScaling

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
ROPE_TYPES = ("llama3", "linear", "yarn")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # the tanh approximation, each in its own formula
GELU_EXACT = ("gelu",)  # transformers' "gelu": torch's exact (erf) GELU, nanoGPT's nn.GELU()

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.q.bias": "self_attn.q_proj.bias",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.k.bias": "self_attn.k_proj.bias",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.v.bias": "self_attn.v_proj.bias",
    "attn.out.weight": "self_attn.o_proj.weight",
    "attn.out.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.gate.bias": "mlp.gate_proj.bias",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.up.bias": "mlp.up_proj.bias",
    "mlp.down.weight": "mlp.down_proj.weight",
    "mlp.down.bias": "mlp.down_proj.bias",
}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_TOP_BACK = {v: k for k, v in _TOP.items()}


class HFConfigError(ValueError):
    """A config.json key whose value seqtrain's GPT cannot represent; the message names the key."""


def to_hf_name(name: str) -> str:
    """Llama-style name (llama, mistral, qwen2, qwen3) of a seqtrain GPT tensor."""
    if name in _TOP:
        return _TOP[name]
    m = re.match(r"blocks\.(\d+)\.(.+)$", name)
    if not m or m.group(2) not in _BLOCK:
        raise KeyError(f"no Llama-style name for seqtrain tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def from_hf_name(name: str) -> str | None:
    """seqtrain name of a Llama-style tensor; None for tensors seqtrain has no use for (rotary inv_freq buffers)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if m and m.group(2) in _BLOCK_BACK:
        return f"blocks.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}"
    if name.endswith("rotary_emb.inv_freq"):
        return None
    raise KeyError(f"{name!r} is not a tensor seqtrain's GPT has (a different architecture?)")


def family_of(spec: ModelSpec) -> str:
    """The transformers family a GPT spec exports as: the narrowest one that computes exactly this block."""
    if spec.norm == "layernorm" or spec.mlp != "swiglu" or spec.positions == "learned":
        return "gpt2"
    if spec.qk_norm:
        return "qwen3"
    if spec.sliding_window is not None:
        return "mistral"
    if spec.qkv_bias and not spec.out_bias and not spec.mlp_bias:
        return "qwen2"
    return "llama"


def gpt2_problems(spec: ModelSpec) -> list[str]:
    """What keeps a GPT spec that needs GPT-2's block (layernorm, gelu or learned positions) from being a GPT-2."""
    want = {"norm": "layernorm", "has_norm_bias": True, "positions": "learned", "qkv_bias": True,
            "out_bias": True, "mlp_bias": True, "qk_norm": False, "sliding_window": None, "rope_scaling": None}
    out = [f"{k.removeprefix('has_')} {getattr(spec, k)!r} (GPT-2 has {v!r})" for k, v in want.items()
           if getattr(spec, k) != v]
    if spec.mlp not in ("gelu", "gelu-exact"):
        out.append(f"mlp {spec.mlp!r} (GPT-2 has 'gelu' or 'gelu-exact')")
    if spec.kv_heads != spec.heads:
        out.append(f"kv_heads {spec.kv_heads} (GPT-2 has one per head, {spec.heads})")
    if spec.head_dim not in (None, (spec.dim or 0) // (spec.heads or 1)):
        out.append(f"head_dim {spec.head_dim} (GPT-2's is dim / heads)")
    if not spec.tie_embeddings:
        out.append("tie_embeddings false (GPT-2's output projection is the token embedding)")
    return out


def _rope_config(spec: ModelSpec) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    s = spec.rope_scaling
    if s is not None:
        params = {"rope_type": s.type, "rope_theta": spec.rope_theta, "factor": s.factor}
        if s.type in ("llama3", "yarn"):
            params["original_max_position_embeddings"] = s.original_max_seq_len or spec.max_seq_len
        if s.type == "llama3":
            params |= {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor}
        if s.type == "yarn":
            params |= {"beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(s, key) is not None:
                    params[key] = getattr(s, key)
    # transformers 4.x reads rope_theta and rope_scaling, 5.x rope_parameters: all, same values.
    scaling = None if s is None else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": spec.rope_theta, "rope_parameters": params, "rope_scaling": scaling}


def hf_config(spec: ModelSpec, tokenizer: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of the family `family_of(spec)` for a resolved GPT spec."""
    assert spec.dim and spec.heads and spec.kv_heads and spec.ffn_dim and spec.layers and spec.vocab_size
    tok = tokenizer or {}
    family = family_of(spec)
    common = {"vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tie_embeddings,
              "initializer_range": spec.init_std, "bos_token_id": tok.get("bos_token_id"),
              "eos_token_id": tok.get("eos_token_id"), "pad_token_id": None, "torch_dtype": "float32",
              "use_cache": True}
    if family == "gpt2":
        problems = gpt2_problems(spec)
        if problems:
            raise HFConfigError("no transformers family computes this block: its layernorm, gelu or learned "
                                f"positions need GPT-2's, but it has {'; '.join(problems)}; export with "
                                "--format seqtrain")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": spec.dim,
                "n_layer": spec.layers, "n_head": spec.heads, "n_inner": spec.ffn_dim, "n_positions": spec.max_seq_len,
                "n_ctx": spec.max_seq_len, "activation_function": "gelu" if spec.mlp == "gelu-exact" else "gelu_new",
                "layer_norm_epsilon": spec.norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, **common}
    if family == "mistral" and (spec.qkv_bias or spec.out_bias or spec.mlp_bias):
        raise HFConfigError("a slidingWindow model exports as mistral, which has no biases (qkvBias, outBias, "
                            "mlpBias); export with --format seqtrain")
    if family == "qwen3" and (spec.qkv_bias != spec.out_bias or spec.mlp_bias or spec.sliding_window):
        raise HFConfigError("a qkNorm model exports as qwen3, which has one attention_bias for q/k/v/o, no MLP "
                            "bias and no sliding window; export with --format seqtrain")
    if family == "llama" and spec.qkv_bias != spec.out_bias:
        raise HFConfigError("llama has one attention_bias for q/k/v/o; export with --format seqtrain")
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[family]
    cfg: dict[str, Any] = {
        "architectures": [arch], "model_type": family, "hidden_size": spec.dim, "intermediate_size": spec.ffn_dim,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_size, "hidden_act": "silu", "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": spec.norm_eps, **_rope_config(spec), "attention_dropout": 0.0, **common,
    }
    if family == "llama":
        cfg |= {"attention_bias": spec.qkv_bias, "mlp_bias": spec.mlp_bias}
    elif family == "qwen3":
        cfg |= {"attention_bias": spec.qkv_bias, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": spec.layers, "layer_types": ["full_attention"] * spec.layers}
    elif family == "qwen2":
        cfg |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": spec.layers,
                "layer_types": ["full_attention"] * spec.layers}
    elif family == "mistral":
        cfg["sliding_window"] = spec.sliding_window
    return cfg


def llama_config(spec: ModelSpec, tokenizer: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for a resolved GPT spec (its family by `family_of`; Llama for the default block)."""
    return hf_config(spec, tokenizer)


def _rope_scaling_of(cfg: dict[str, Any], where: str, max_len: int) -> tuple[float | None, RopeScaling | None]:
    """(rope_theta, scaling) of a config in transformers 4.x (rope_theta + rope_scaling) or 5.x
    (rope_parameters) form."""
    key = "rope_parameters" if isinstance(cfg.get("rope_parameters"), dict) else "rope_scaling"
    rope = cfg.get(key) or {}
    if not isinstance(rope, dict):
        raise HFConfigError(f"{where}: {key} is not an object")
    if any(isinstance(v, dict) for v in rope.values()):
        raise HFConfigError(f"{where}: {key} per layer type ({', '.join(sorted(rope))}) is not supported; "
                            "seqtrain's GPT has one RoPE for all layers")
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    type_key = "rope_type" if "rope_type" in rope else "type"
    kind = rope.get(type_key, "default")
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) not in (1, 1.0, None):
        k = f"{key}.partial_rotary_factor" if "partial_rotary_factor" in rope else "partial_rotary_factor"
        raise HFConfigError(f"{where}: {k} {rope.get('partial_rotary_factor', cfg.get('partial_rotary_factor'))} "
                            "is not supported; seqtrain rotates the whole head (1.0)")
    if kind in ("default", None):
        return theta, None
    if kind not in ROPE_TYPES:
        raise HFConfigError(f"{where}: {key}.{type_key} {kind!r} is not supported; supported: "
                            f"{', '.join(ROPE_TYPES)}")
    if rope.get("factor") is None:
        raise HFConfigError(f"{where}: {key}.factor is missing for rope_type {kind!r}")
    original = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    extra: dict[str, Any] = {}
    if kind == "llama3":
        extra = {"low_freq_factor": rope.get("low_freq_factor", 1.0), "high_freq_factor": rope.get("high_freq_factor", 4.0)}
    elif kind == "yarn":
        extra = {"beta_fast": rope.get("beta_fast") or 32.0, "beta_slow": rope.get("beta_slow") or 1.0,
                 "attention_factor": rope.get("attention_factor"), "mscale": rope.get("mscale"),
                 "mscale_all_dim": rope.get("mscale_all_dim"), "truncate": bool(rope.get("truncate", True))}
    if kind in ("llama3", "yarn"):
        extra["original_max_seq_len"] = int(original or max_len)
    try:
        return theta, RopeScaling(type=kind, factor=float(rope["factor"]), **extra)
    except ValueError as exc:
        raise HFConfigError(f"{where}: {key}: {str(exc).splitlines()[-1].strip()}") from None


def _window_of(cfg: dict[str, Any], family: str, where: str) -> int | None:
    """The sliding window every layer uses, or None; mixed full/sliding layers are refused."""
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    kinds = set(cfg.get("layer_types") or [])
    if kinds - {"full_attention", "sliding_attention"}:
        raise HFConfigError(f"{where}: layer_types {sorted(kinds)} is not supported; supported: full_attention, "
                            "sliding_attention")
    if kinds == {"full_attention"}:
        return None
    if len(kinds) > 1 or (kinds == {"sliding_attention"} and window is None):
        raise HFConfigError(f"{where}: layer_types mixes full and sliding attention, which is not supported; "
                            "seqtrain's GPT uses one window in every layer")
    if family in ("qwen2", "qwen3") and window is not None and not kinds \
            and int(cfg.get("max_window_layers", 0)) < int(cfg.get("num_hidden_layers", 0)):
        raise HFConfigError(f"{where}: max_window_layers {cfg.get('max_window_layers')} mixes full and sliding "
                            "attention, which is not supported; seqtrain's GPT uses one window in every layer")
    return int(window) if window is not None else None


def _need(cfg: dict[str, Any], where: str, *keys: str) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise HFConfigError(f"{where}: lacks {', '.join(missing)}")


def _refuse_unless(cfg: dict[str, Any], where: str, key: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = cfg.get(key, default)
    if value not in allowed:
        raise HFConfigError(f"{where}: {key} {value!r} is not supported; supported: "
                            f"{', '.join(repr(a) for a in allowed)}")


def _gpt2_spec(cfg: dict[str, Any], where: str) -> ModelSpec:
    _need(cfg, where, "vocab_size", "n_embd", "n_layer", "n_head")
    _refuse_unless(cfg, where, "activation_function", GELU_TANH + GELU_EXACT, "gelu_new")
    _refuse_unless(cfg, where, "scale_attn_weights", (True,), True)
    _refuse_unless(cfg, where, "scale_attn_by_inverse_layer_idx", (False,), False)
    _refuse_unless(cfg, where, "add_cross_attention", (False,), False)
    _refuse_unless(cfg, where, "tie_word_embeddings", (True,), True)
    dim, heads = int(cfg["n_embd"]), int(cfg["n_head"])
    return ModelSpec(
        arch="gpt", vocab_size=int(cfg["vocab_size"]), dim=dim, layers=int(cfg["n_layer"]), heads=heads,
        kv_heads=heads, ffn_dim=int(cfg.get("n_inner") or 4 * dim), max_seq_len=int(cfg.get("n_positions", 1024)),
        norm="layernorm", mlp="gelu-exact" if cfg.get("activation_function") in GELU_EXACT else "gelu",
        positions="learned", qkv_bias=True, out_bias=True, mlp_bias=True,
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), tie_embeddings=True,
        init_std=float(cfg.get("initializer_range", 0.02)),
    )


def spec_from_hf_config(cfg: dict[str, Any], where: str) -> ModelSpec:
    """The GPT ModelSpec of a transformers config.json (llama, mistral, qwen2, qwen3, gpt2); HFConfigError naming
    the key for anything seqtrain's GPT cannot represent."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise HFConfigError(f"{where}: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    if family == "gpt2":
        return _gpt2_spec(cfg, where)
    _need(cfg, where, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    _refuse_unless(cfg, where, "hidden_act", ("silu",), "silu")
    heads, dim = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    max_len = int(cfg.get("max_position_embeddings") or 2048)
    theta, scaling = _rope_scaling_of(cfg, where, max_len)
    qkv = out = mlp = False
    if family == "llama":
        qkv = out = bool(cfg.get("attention_bias", False))
        mlp = bool(cfg.get("mlp_bias", False))
    elif family == "qwen2":
        qkv = True
    elif family == "qwen3":
        qkv = out = bool(cfg.get("attention_bias", False))
    head_dim = cfg.get("head_dim")
    if family == "qwen3" and head_dim is None:
        head_dim = 128  # Qwen3Config's default, written out by every Qwen3 config on the hub
    head_dim = int(head_dim) if head_dim is not None and int(head_dim) != dim // heads else None
    if head_dim is None and dim % heads:
        raise HFConfigError(f"{where}: hidden_size {dim} is not a multiple of num_attention_heads {heads} and "
                            "head_dim is not given")
    window = _window_of(cfg, family, where) if family in ("mistral", "qwen2", "qwen3") else None
    return ModelSpec(
        arch="gpt", vocab_size=int(cfg["vocab_size"]), dim=dim, layers=int(cfg["num_hidden_layers"]),
        heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads), ffn_dim=int(cfg["intermediate_size"]),
        max_seq_len=max_len, rope_theta=float(theta if theta is not None else 10000.0),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_std=float(cfg.get("initializer_range", 0.02)), head_dim=head_dim, rope_scaling=scaling,
        qkv_bias=qkv, out_bias=out, mlp_bias=mlp, qk_norm=family == "qwen3", sliding_window=window,
    )


# the name every caller used before the other families existed
spec_from_llama_config = spec_from_hf_config
