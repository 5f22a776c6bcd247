"""`seqtrain export`: write a model folder other tools load.

GPT with `--format hf`: a Hugging Face Llama folder (config.json, model.safetensors, the tokenizer when the job had
a tokenizer.json) that `transformers.AutoModelForCausalLM.from_pretrained` loads. LSTM/GRU/QRNN (and GPT with
`--format seqtrain`): seqtrain's own format, model.safetensors with seqtrain's tensor names plus config.json.
Both write `seqtrain.json` (the model section and tokenizer), so `model.init` and `seqtrain generate` read the
folder back exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from typing import Any

import torch

from seqtrain.export.weights import SEQTRAIN_JSON, Weights, WeightsError, load_source
from seqtrain.spec import hf


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def export(source: str | Weights, out: str, fmt: str = "hf", merge_lora: bool = False) -> dict[str, Any]:
    """Write `source` (any `load_source` path, or loaded Weights) to the folder `out`; returns a summary."""
    from safetensors.torch import save_file

    w = source if isinstance(source, Weights) else load_source(source)
    if w.lora is not None:
        from seqtrain.export.merge import merge_weights

        if not merge_lora:
            raise WeightsError(f"{w.origin}: holds LoRA adapters; pass --merge-lora to write merged weights")
        w = merge_weights(w)
    w = dataclasses.replace(w, spec=w.spec.model_copy(update={"init": None, "lora": None}))  # self-contained
    if fmt not in ("hf", "seqtrain"):
        raise WeightsError(f"--format: {fmt!r} is not hf or seqtrain")
    if fmt == "hf" and w.spec.arch != "gpt":
        print(f"seqtrain export: {w.spec.arch} has no Hugging Face equivalent; writing seqtrain's safetensors "
              "format", file=sys.stderr)
        fmt = "seqtrain"
    os.makedirs(out, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in w.state.items():
        # A tied model has no lm_head tensor; each tensor gets its own storage (safetensors refuses shared ones).
        tensors[hf.to_hf_name(name) if fmt == "hf" else name] = t.detach().float().cpu().contiguous().clone()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tok = dict(w.tokenizer)
    if tok.get("refused"):
        raise WeightsError(tok["refused"])
    if tok.get("type") == "file":
        shutil.copyfile(tok["path"], os.path.join(out, "tokenizer.json"))
        _write_json(os.path.join(out, "tokenizer_config.json"), {"tokenizer_class": "PreTrainedTokenizerFast"})
        tok = {**tok, "path": "tokenizer.json"}
    if fmt == "hf":
        _write_json(os.path.join(out, "config.json"), hf.llama_config(w.spec))
        _write_json(os.path.join(out, "generation_config.json"), {"do_sample": False})
    else:
        _write_json(os.path.join(out, "config.json"), {"model_type": f"seqtrain-{w.spec.arch}",
                                                       "seqtrain": w.spec.to_dict()})
    _write_json(os.path.join(out, SEQTRAIN_JSON), {
        "format": fmt, "model": w.spec.to_dict(), "tokenizer": tok, "source": w.origin,
    })
    n = sum(t.numel() for t in tensors.values())
    return {"out": out, "format": fmt, "tensors": len(tensors), "parameters": n, "arch": w.spec.arch}


def export_command(source: str, out: str, fmt: str, merge_lora: bool) -> int:
    from seqtrain.checkpoint.safe_load import CheckpointUnavailable

    try:
        info = export(source, out, fmt, merge_lora)
    except WeightsError as exc:
        print(f"seqtrain export: {exc}", file=sys.stderr)
        return 2
    except CheckpointUnavailable as exc:  # out of memory, storage I/O: try again later
        print(f"seqtrain export: {exc}", file=sys.stderr)
        return 1
    print(f"{info['out']}: {info['arch']} as {info['format']} ({info['tensors']} tensors, "
          f"{info['parameters']:,} parameters)")
    return 0
