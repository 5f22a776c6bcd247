"""Tensors of a Hugging Face folder <-> seqtrain GPT state dicts, per family (`seqtrain.spec.hf` has the configs).

Llama-style families (llama, mistral, qwen2, qwen3) are a renaming. GPT-2 stores its linear layers as Conv1D,
weight [in, out] (y = x W + b), and q/k/v as one `c_attn` of [dim, 3 dim]: seqtrain's `nn.Linear` weights are the
transposes, and q/k/v are the three column blocks of `c_attn` in that order. GPT-2's `attn.bias` /
`attn.masked_bias` are causal-mask buffers, not weights; folders saved from `GPT2Model` (the original hub
checkpoints) have no `transformer.` prefix.
"""

from __future__ import annotations

import re

import torch

from seqtrain.spec import hf
from seqtrain.spec.model import ModelSpec

_GPT2_TOP = {"embed.weight": "transformer.wte.weight", "pos_embed.weight": "transformer.wpe.weight",
             "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}
_GPT2_TOP_BACK = {v: k for k, v in _GPT2_TOP.items()}
_GPT2_BLOCK = {  # seqtrain -> GPT-2 for the tensors that need no transpose
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "mlp_norm.weight": "ln_2.weight", "mlp_norm.bias": "ln_2.bias",
    "attn.out.bias": "attn.c_proj.bias", "mlp.up.bias": "mlp.c_fc.bias", "mlp.down.bias": "mlp.c_proj.bias",
}
_GPT2_CONV = {"attn.out.weight": "attn.c_proj.weight", "mlp.up.weight": "mlp.c_fc.weight",
              "mlp.down.weight": "mlp.c_proj.weight"}  # transposed
_GPT2_BLOCK_BACK = {v: k for k, v in _GPT2_BLOCK.items()}
_GPT2_CONV_BACK = {v: k for k, v in _GPT2_CONV.items()}
_GPT2_BUFFERS = re.compile(r"\.attn\.(bias|masked_bias)$")


def to_hf(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """seqtrain state (full tensors) -> the tensors of `hf.family_of(spec)`'s folder; HFConfigError when no
    transformers family computes the spec's block."""
    hf.hf_config(spec)
    if hf.family_of(spec) != "gpt2":
        return {hf.to_hf_name(name): t for name, t in state.items()}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        if name in _GPT2_TOP:
            out[_GPT2_TOP[name]] = t
            continue
        m = re.match(r"blocks\.(\d+)\.(.+)$", name)
        if not m:
            raise KeyError(f"no GPT-2 name for seqtrain tensor {name!r}")
        i, local = m.group(1), m.group(2)
        prefix = f"transformer.h.{i}."
        if local in _GPT2_BLOCK:
            out[prefix + _GPT2_BLOCK[local]] = t
        elif local in _GPT2_CONV:
            out[prefix + _GPT2_CONV[local]] = t.t()
        elif (q := re.match(r"attn\.(q|k|v)\.(weight|bias)$", local)) is not None:
            qkv.setdefault(f"{prefix}attn.c_attn.{q.group(2)}", {})[q.group(1)] = t
        else:
            raise KeyError(f"no GPT-2 name for seqtrain tensor {name!r}")
    for name, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise KeyError(f"{name}: needs q, k and v, has {', '.join(sorted(parts))}")
        fused = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)  # [3 dim, dim] or [3 dim]
        out[name] = fused.t() if name.endswith("weight") else fused
    return out


def from_hf(family: str, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The tensors of a `family` folder -> seqtrain state (fp32); KeyError naming a tensor seqtrain has no use
    for (a different architecture)."""
    out: dict[str, torch.Tensor] = {}
    if family != "gpt2":
        for name, t in tensors.items():
            local = hf.from_hf_name(name)
            if local is not None:
                out[local] = t.float()
        return out
    for name, t in tensors.items():
        if _GPT2_BUFFERS.search(name):
            continue
        full = name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"
        if full == "lm_head.weight":
            continue  # tied to transformer.wte.weight (GPT-2 always ties)
        if full in _GPT2_TOP_BACK:
            out[_GPT2_TOP_BACK[full]] = t.float()
            continue
        m = re.match(r"transformer\.h\.(\d+)\.(.+)$", full)
        if not m:
            raise KeyError(f"{name!r} is not a GPT-2 tensor seqtrain knows ({where})")
        i, local = m.group(1), m.group(2)
        prefix = f"blocks.{i}."
        if local in _GPT2_BLOCK_BACK:
            out[prefix + _GPT2_BLOCK_BACK[local]] = t.float()
        elif local in _GPT2_CONV_BACK:
            out[prefix + _GPT2_CONV_BACK[local]] = t.float().t().contiguous()
        elif local in ("attn.c_attn.weight", "attn.c_attn.bias"):
            fused = t.float().t() if local.endswith("weight") else t.float()
            kind = local.rpartition(".")[2]
            for part, chunk in zip("qkv", fused.chunk(3, dim=0), strict=True):
                out[f"{prefix}attn.{part}.{kind}"] = chunk.contiguous()
        else:
            raise KeyError(f"{name!r} is not a GPT-2 tensor seqtrain knows ({where})")
    return out
