"""`model.init`: copy weights from an export, run, checkpoint or Hugging Face Llama folder into a fresh model."""

from __future__ import annotations

import torch

from seqtrain.export.weights import WeightsError, check_shapes, load_source, pad_vocab
from seqtrain.runtime.exitcodes import InvalidConfig


class InitWeightsError(WeightsError, InvalidConfig):
    """model.init weights refused, corrupt or unfit: the job's input (the trainer exits 3, restarting cannot help)."""


def load_initial_weights(model: torch.nn.Module, path: str) -> str:
    """Load the weights at `path` into `model` (built from the job's resolved spec, before any parallelism);
    a shape mismatch raises WeightsError naming every offending tensor. Returns a log line."""
    try:
        w = load_source(path)
        if w.lora is not None:  # a LoRA run as the starting point: its adapters merged into its base
            from seqtrain.export.merge import merge_weights

            w = merge_weights(w)
        origin = f"model.init {path!r}"
        w.state = pad_vocab(model, w.state)  # model.padVocabTo: zero pad rows below the real vocabulary
        check_shapes(w.state, model, origin)
    except WeightsError as exc:  # refused, corrupt or unfit weights: the job's input, restarting cannot help
        raise InitWeightsError(f"spec.model.init: {exc}") from None
    with torch.no_grad():
        model.load_state_dict(w.state, strict=True)  # copies into the model's own device and dtype
    n = sum(t.numel() for t in w.state.values())
    return f"model.init: {n / 1e6:.2f}M parameters from {w.origin}"
