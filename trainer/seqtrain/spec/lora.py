"""LoRA parameter counts from the spec alone (torch-free: `seqtrain plan` and validation use them)."""

from __future__ import annotations

from seqtrain.spec.model import LORA_TARGETS, ModelSpec


def target_shapes(m: ModelSpec) -> dict[str, tuple[int, int]]:
    """[out, in] of each LoRA target of one block / layer of a resolved model."""
    d = m.dim or 0
    if m.arch == "gpt":
        hd = d // (m.heads or 1)
        q, kv, f = (m.heads or 0) * hd, (m.kv_heads or 0) * hd, m.ffn_dim or 0
        return {"q": (q, d), "k": (kv, d), "v": (kv, d), "out": (d, q), "gate": (f, d), "up": (f, d), "down": (d, f)}
    if m.arch == "lstm":
        return {"weight_ih": (4 * d, d), "weight_hh": (4 * d, d)}
    if m.arch == "gru":
        return {"weight_ih": (3 * d, d), "weight_hh": (3 * d, d)}
    return {"proj": (3 * d, 2 * d)}


def lora_param_count(m: ModelSpec) -> int:
    """Trainable parameters LoRA adds to a resolved model (0 without model.lora)."""
    if m.lora is None:
        return 0
    shapes = target_shapes(m)
    r = m.lora.rank
    return (m.layers or 0) * sum(r * (shapes[t][0] + shapes[t][1]) for t in m.lora.targets(m.arch) if t in shapes)


def unknown_targets(m: ModelSpec) -> list[str]:
    if m.lora is None or not m.lora.target_modules:
        return []
    return [t for t in m.lora.target_modules if t not in LORA_TARGETS[m.arch]]
