"""`seqtrain export`: write a model folder other tools load.

GPT with `--format hf`: a Hugging Face Llama folder (config.json, model.safetensors, the tokenizer when the job had
a tokenizer.json) that `transformers.AutoModelForCausalLM.from_pretrained` loads. LSTM/GRU/QRNN (and GPT with
`--format seqtrain`): seqtrain's own format, model.safetensors with seqtrain's tensor names plus config.json.
Both write `seqtrain.json` (the model section and tokenizer), so `model.init` and `seqtrain generate` read the
folder back exactly.

The folder appears whole or not at all: everything is checked first, then written into a temporary sibling
(`.NAME.tmp-*`) that is renamed to `--out` at the end and removed on any failure. An `--out` that is an earlier
export is replaced; one that holds anything else is refused, so a mistyped `--out` never loses files.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from seqtrain.export.weights import SEQTRAIN_JSON, Weights, WeightsError, hf_state, load_source
from seqtrain.spec import hf
from seqtrain.spec.init_source import TOKENIZER_COMPANIONS


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
    tok = dict(w.tokenizer)
    if tok.get("refused"):
        raise WeightsError(tok["refused"])
    if tok.get("type") == "file" and not os.path.isfile(tok["path"]):
        raise WeightsError(f"{w.origin}: its tokenizer {tok['path']} is gone; copy it back there or into the run "
                           "folder as tokenizer.json")
    _check_out(out)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in (hf_state(w.spec, w.state) if fmt == "hf" else w.state).items():
        # A tied model has no lm_head tensor; each tensor gets its own storage (safetensors refuses shared ones).
        tensors[name] = t.detach().float().cpu().contiguous().clone()
    with _staged(out) as folder:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        if tok.get("type") == "file":
            shutil.copyfile(tok["path"], os.path.join(folder, "tokenizer.json"))
            # special tokens and chat template travel with the tokenizer when they lie beside it
            near = [os.path.join(os.path.dirname(tok["path"]), n) for n in TOKENIZER_COMPANIONS]
            for src in [p for p in near if os.path.isfile(p) and not os.path.islink(p)]:
                shutil.copyfile(src, os.path.join(folder, os.path.basename(src)))
            if not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
                _write_json(os.path.join(folder, "tokenizer_config.json"),
                            {"tokenizer_class": "PreTrainedTokenizerFast"})
            tok = {**tok, "path": "tokenizer.json"}
        if fmt == "hf":
            _write_json(os.path.join(folder, "config.json"), hf.llama_config(w.spec))
            _write_json(os.path.join(folder, "generation_config.json"), {"do_sample": False})
        else:
            _write_json(os.path.join(folder, "config.json"), {"model_type": f"seqtrain-{w.spec.arch}",
                                                              "seqtrain": w.spec.to_dict()})
        _write_json(os.path.join(folder, SEQTRAIN_JSON), {
            "format": fmt, "model": w.spec.to_dict(), "tokenizer": tok, "source": w.origin,
        })
    n = sum(t.numel() for t in tensors.values())
    return {"out": out, "format": fmt, "tensors": len(tensors), "parameters": n, "arch": w.spec.arch}


def _check_out(out: str) -> None:
    """`--out` may be absent, an empty folder or an earlier export (replaced); anything else is refused before a
    byte is written."""
    out = os.path.abspath(out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise WeightsError(f"--out {out}: exists and is not a folder; name a new folder (or an earlier export, "
                           "which is replaced)")
    if os.path.isdir(out):
        try:
            held = os.listdir(out)
        except OSError as exc:
            raise WeightsError(f"--out {out}: cannot read it ({exc.strerror}); name a folder you can write") from None
        if held and SEQTRAIN_JSON not in held:
            raise WeightsError(f"--out {out}: holds files that are not a seqtrain export ({', '.join(sorted(held)[:3])}"
                               f"{' ...' if len(held) > 3 else ''}); name a new or empty folder")


class ExportWriteFailed(Exception):
    """Writing the model folder failed (disk full, I/O error); nothing was left under --out. Exit 1: not the
    input's fault."""


@contextmanager
def _staged(out: str) -> Iterator[str]:
    """A new folder beside `out` to write into; renamed to `out` when the block ends, removed when it raises."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{secrets.token_hex(4)}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    except OSError as exc:
        raise WeightsError(f"--out {out}: cannot create a folder in {parent} ({exc.strerror}); name a folder you can "
                           "write") from None
    try:
        yield tmp
        _publish(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportWriteFailed(f"writing {out}: {exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: str, out: str) -> None:
    """Rename the finished folder `tmp` to `out`: at once when `out` is absent or empty; an earlier export is moved
    aside first and removed once the new one is in place."""
    try:
        os.rename(tmp, out)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    old = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.old-{secrets.token_hex(4)}")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


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
    except ExportWriteFailed as exc:
        print(f"seqtrain export: {exc}", file=sys.stderr)
        return 1
    print(f"{info['out']}: {info['arch']} as {info['format']} ({info['tensors']} tensors, "
          f"{info['parameters']:,} parameters)")
    return 0
