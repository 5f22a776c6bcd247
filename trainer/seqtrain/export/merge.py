"""A LoRA run's weights merged into its base: what `seqtrain export --merge-lora`, `generate` and `model.init`
read from a run that trained adapters only."""

from __future__ import annotations

import torch

from seqtrain.models.lora import merge_state


def merge_weights(w):  # noqa: ANN001, ANN201 - seqtrain.export.weights.Weights in and out
    """A LoRA run's Weights (adapters only) -> merged full Weights without LoRA: the base comes from the job's
    `model.init`, or, without one, from the job's seeded random initialisation (as the trainer built it)."""
    from seqtrain.export.weights import Weights, WeightsError, load_source
    from seqtrain.models import build_model
    from seqtrain.spec.model import LoraSpec

    lora = LoraSpec.model_validate(w.lora)
    spec = w.spec.model_copy(update={"lora": None})
    job = w.job
    init = spec.init
    if init:
        base = load_source(init)
        if base.lora is not None:
            base = merge_weights(base)
        base_state = base.state
    elif job is not None:
        torch.manual_seed(job.spec.training.seed)  # the trainer's seed_all(seed) before build_model
        base_state = build_model(spec).state_dict()
    else:
        raise WeightsError(f"{w.origin}: LoRA adapters without the base weights they adapt")
    try:
        merged = merge_state(base_state, w.state, lora)
    except KeyError as exc:
        raise WeightsError(f"{w.origin}: {exc.args[0]}") from None
    return Weights(spec=spec, state=merged, tokenizer=w.tokenizer, job=job, origin=w.origin, lora=None)
