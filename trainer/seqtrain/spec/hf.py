"""seqtrain GPT <-> Hugging Face Llama: config and tensor names.

seqtrain's GPT is Llama-shaped: RMSNorm (weight only, eps `model.normEps`, computed in fp32), rotate-half RoPE
(the two halves of each head dimension form the rotated pairs, exactly `transformers`' `rotate_half`, so q/k
weights need no permutation), SwiGLU `down(silu(gate(x)) * up(x))`, grouped-query attention where kv head j
serves query heads j*rep .. (j+1)*rep-1 (`repeat_interleave`, the same as Llama's `repeat_kv`), no biases, and an
optional tied output projection. The mapping below is therefore a renaming.
"""

from __future__ import annotations

import re
from typing import Any

from seqtrain.spec.model import ModelSpec

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.out.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_TOP_BACK = {v: k for k, v in _TOP.items()}


def to_hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    m = re.match(r"blocks\.(\d+)\.(.+)$", name)
    if not m or m.group(2) not in _BLOCK:
        raise KeyError(f"no Llama name for seqtrain tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def from_hf_name(name: str) -> str | None:
    """seqtrain name of a Llama tensor; None for tensors seqtrain has no use for (rotary inv_freq buffers)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if m and m.group(2) in _BLOCK_BACK:
        return f"blocks.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}"
    if name.endswith("rotary_emb.inv_freq"):
        return None
    raise KeyError(f"{name!r} is not a Llama tensor seqtrain knows (a different architecture?)")


def llama_config(spec: ModelSpec, tokenizer: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of `LlamaForCausalLM` for a resolved GPT spec."""
    assert spec.dim and spec.heads and spec.kv_heads and spec.ffn_dim and spec.layers and spec.vocab_size
    tok = tokenizer or {}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.dim,
        "intermediate_size": spec.ffn_dim,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.dim // spec.heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": spec.norm_eps,
        # transformers 4.x reads rope_theta, 5.x rope_parameters: both, same value.
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_embeddings,
        "initializer_range": spec.init_std,
        "bos_token_id": tok.get("bos_token_id"),
        "eos_token_id": tok.get("eos_token_id"),
        "pad_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def spec_from_llama_config(cfg: dict[str, Any], where: str) -> ModelSpec:
    """The GPT ModelSpec of a Llama config.json; a clear error for what seqtrain's GPT cannot represent."""
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} is not llama; seqtrain's GPT loads "
                         "Llama-shaped models only")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in cfg]
    if missing:
        raise ValueError(f"{where}: lacks {', '.join(missing)}")
    problems = []
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        problems.append("attention_bias/mlp_bias (seqtrain's GPT has no biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg.get('hidden_act')!r} (seqtrain uses silu)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        problems.append(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} (seqtrain has plain RoPE)")
    heads = int(cfg["num_attention_heads"])
    dim = int(cfg["hidden_size"])
    if cfg.get("head_dim") not in (None, dim // heads):
        problems.append(f"head_dim {cfg['head_dim']} != hidden_size / num_attention_heads ({dim // heads})")
    if problems:
        raise ValueError(f"{where}: not representable as a seqtrain GPT: " + "; ".join(problems))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return ModelSpec(
        arch="gpt", vocab_size=int(cfg["vocab_size"]), dim=dim, layers=int(cfg["num_hidden_layers"]),
        heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads), ffn_dim=int(cfg["intermediate_size"]),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)), rope_theta=float(theta),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_std=float(cfg.get("initializer_range", 0.02)),
    )
