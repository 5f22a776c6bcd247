"""Model zoo: `build_model(spec)` for every `model.arch`, `count_parameters` for plans and docs.

Every model: `forward(tokens[B, T], doc_ids[B, T] | None = None) -> hidden[B, T, D]` and an `output_weight`
property (the [vocab, dim] projection the loss applies). GPT blocks are `model.blocks`, RNN layers `model.layers`.
"""

from __future__ import annotations

from torch import nn

from seqtrain.models.gpt import GPT
from seqtrain.models.gru import GRULM
from seqtrain.models.lstm import LSTMLM
from seqtrain.models.qrnn import QRNNLM
from seqtrain.spec.model import ModelSpec

__all__ = ["GPT", "GRULM", "LSTMLM", "QRNNLM", "build_model", "count_parameters"]


def build_model(spec: ModelSpec) -> nn.Module:
    """Build the model of a resolved spec (`seqtrain.spec.resolve` fills preset dims) on the current device."""
    if spec.dim is None or spec.layers is None or spec.vocab_size is None:
        raise ValueError("model spec is not resolved: call seqtrain.spec.resolve(job) first")
    if spec.arch == "gpt":
        return GPT(spec)
    if spec.arch == "lstm":
        return LSTMLM(spec)
    if spec.arch == "gru":
        return GRULM(spec)
    if spec.arch == "qrnn":
        return QRNNLM(spec)
    raise ValueError(f"spec.model.arch: unknown architecture {spec.arch!r}; use gpt, lstm, gru or qrnn")


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += getattr(p, "ds_numel", None) or p.numel()  # a ZeRO-3 partitioned parameter's own numel is 0
    return total
