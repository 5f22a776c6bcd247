"""LoRA (Hu et al. 2021) for seqtrain's models: frozen weights W, trainable low-rank A [r, in] and B [out, r],
output W x + (alpha / r) B A dropout(x). B starts at zero, so a fresh adapter leaves the model unchanged.

Own implementation rather than peft (see docs/architecture.md): peft has no adapters for `nn.LSTM`/`nn.GRU`, and
its wrappers rename every adapted weight (`base_layer.weight`), which seqtrain's checkpoint, consolidation,
export and `model.init` name contracts rely on. Here:
- linear targets (GPT q/k/v/out/gate/up/down, QRNN proj) become `LoRALinear`, an `nn.Linear` that keeps its
  `weight` under the same name and adds `lora_A`/`lora_B` (peft's names and initialisation: A Kaiming-uniform,
  B zero);
- LSTM/GRU weight matrices (`weight_ih_l0`, `weight_hh_l0`) get a `torch.nn.utils.parametrize` parametrization
  W + (alpha / r) B A, because the fused recurrent kernels take whole matrices (no input dropout there);
- every other parameter is frozen, and the model's state dict (hence every checkpoint) holds only the
  adapters; loading one accepts the frozen weights as missing (they come from `model.init`).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn
from torch.nn.utils import parametrize

from seqtrain.spec.model import LoraSpec

_ADAPTER = re.compile(r"(lora_A|lora_B)$")


class LoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=dev, dtype=dt))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=dev, dtype=dt))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (self.lora_dropout(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


class LoRAWeight(nn.Module):
    """Parametrization W -> W + scaling B A of a recurrent layer's weight matrix."""

    def __init__(self, out: int, inp: int, rank: int, alpha: float, like: torch.Tensor) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(rank, inp, device=like.device, dtype=like.dtype))
        self.lora_B = nn.Parameter(torch.zeros(out, rank, device=like.device, dtype=like.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + (self.lora_B @ self.lora_A) * self.scaling


def apply_lora(model: nn.Module, lora: LoraSpec, arch: str) -> int:
    """Freeze `model` and add adapters in place; returns the number of trainable parameters."""
    targets = set(lora.targets(arch))
    for p in model.parameters():
        p.requires_grad_(False)
    if arch in ("lstm", "gru"):
        for layer in model.layers:
            for name in ("weight_ih", "weight_hh"):
                if name in targets:
                    w = getattr(layer, f"{name}_l0")
                    parametrize.register_parametrization(
                        layer, f"{name}_l0", LoRAWeight(w.shape[0], w.shape[1], lora.rank, lora.alpha, w))
    else:
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and not isinstance(child, LoRALinear) and child_name in targets:
                    setattr(parent, child_name, LoRALinear(child, lora.rank, lora.alpha, lora.dropout))
    _adapters_only_state(model)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _adapters_only_state(model: nn.Module) -> None:
    """state_dict() keeps only the adapters; load_state_dict() accepts the frozen weights as missing."""
    def drop_frozen(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        for key in [k for k in state if k.startswith(prefix) and not _ADAPTER.search(k)]:
            del state[key]

    def allow_missing_frozen(module: nn.Module, incompatible) -> None:  # noqa: ANN001
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if _ADAPTER.search(k)]

    model._register_state_dict_hook(drop_frozen)
    model.register_load_state_dict_post_hook(allow_missing_frozen)


def base_name(adapter_key: str) -> tuple[str, str]:
    """('layers.0.weight_ih_l0' or 'blocks.0.attn.q.weight', 'A' | 'B') of an adapter tensor name."""
    m = re.match(r"(.*)\.parametrizations\.(\w+)\.0\.lora_([AB])$", adapter_key)
    if m:
        return f"{m.group(1)}.{m.group(2)}", m.group(3)
    m = re.match(r"(.*)\.lora_([AB])$", adapter_key)
    if not m:
        raise KeyError(f"{adapter_key!r} is not a LoRA adapter tensor")
    return f"{m.group(1)}.weight", m.group(2)


def merge_state(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], lora: LoraSpec
                ) -> dict[str, torch.Tensor]:
    """base weights + scaling B A for every adapter pair; names of the base model."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in adapters.items():
        if not _ADAPTER.search(key):
            continue
        name, ab = base_name(key)
        pairs.setdefault(name, {})[ab] = t
    out = {k: v.clone() for k, v in base.items()}
    scaling = lora.alpha / lora.rank
    for name, ab in pairs.items():
        if name not in out:
            raise KeyError(f"LoRA adapter for {name!r}, which the base weights do not have")
        if set(ab) != {"A", "B"}:
            raise KeyError(f"LoRA adapter for {name!r} lacks its {'A' if 'A' not in ab else 'B'} matrix")
        out[name] = out[name] + (ab["B"].float() @ ab["A"].float()) * scaling
    return out

