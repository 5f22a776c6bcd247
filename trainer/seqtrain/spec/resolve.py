"""Fill every derived default (preset dims, vocabulary, context length) so later code never guesses."""

from __future__ import annotations

import json
import os

from seqtrain.spec.init_source import describe_init
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.model import ModelSpec
from seqtrain.spec.presets import presets_for

BYTE_VOCAB = 256


def paths_readable() -> bool:
    """Whether the job's paths (data, tokenizer, model.init) are this process's to read. Off in the operator
    (`seqtrain operator` sets SEQTRAIN_CHECK_PATHS=0): the files exist in the pods, and a path a user names must
    never make the operator open its own files. Derived fields are then left for the trainer to fill."""
    return os.environ.get("SEQTRAIN_CHECK_PATHS", "1") == "1"


def _prepared_vocab(paths: list[str]) -> int | None:
    """Largest vocabulary (end-of-document id included) of the `seqtrain prepare-data` folders in paths."""
    sizes = []
    for p in paths:
        try:
            with open(os.path.join(os.path.expanduser(p), "index.json"), encoding="utf-8") as f:
                sizes.append(int(json.load(f)["vocab_size"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(sizes) if sizes else None


def tokenizer_vocab_size(job: SeqTrainJob) -> int | None:
    tok = job.spec.data.tokenizer
    if job.spec.data.source == "synthetic":
        # symbols + separator/query markers; see seqtrain.data.synthetic
        return job.spec.data.synthetic.vocab + 4
    if not paths_readable():
        return BYTE_VOCAB if tok.type == "byte" and job.spec.data.source != "tokens" else None
    if job.spec.data.source == "tokens":
        prepared = _prepared_vocab(job.spec.data.paths)
        if prepared is not None:
            return prepared
    if tok.type == "byte":
        return BYTE_VOCAB
    if tok.path and os.path.isfile(tok.path):
        try:
            with open(tok.path, encoding="utf-8") as f:
                data = json.load(f)
            vocab = data.get("model", {}).get("vocab", {})
            added = data.get("added_tokens", [])
            ids = [int(v) for v in (vocab.values() if isinstance(vocab, dict) else range(len(vocab)))]
            ids += [int(t.get("id", 0)) for t in added]
            return max(ids) + 1 if ids else None
        except (OSError, ValueError, AttributeError, TypeError):
            return None
    return None


def resolved_model(job: SeqTrainJob) -> ModelSpec:
    """The model section with the preset and defaults applied (explicit fields win)."""
    m = job.spec.model
    values = m.model_dump()
    explicit = m.model_fields_set
    source = describe_init(m.init) if m.init and paths_readable() else None
    if source and "arch" not in explicit:
        values["arch"] = source["arch"]
    preset = presets_for(values["arch"]).get(m.preset or "tiny", {})
    for key, val in preset.items():
        if key not in explicit or values.get(key) is None:
            values[key] = val
    for key, val in (source or {}).items():  # the weights fix the shapes; explicit fields are checked against them
        if key not in explicit or values.get(key) is None:
            values[key] = val
    if values.get("vocab_size") is None:
        values["vocab_size"] = tokenizer_vocab_size(job) or BYTE_VOCAB
    if values.get("max_seq_len") is None:
        values["max_seq_len"] = job.spec.data.seq_len
    if m.arch == "gpt":
        values["heads"] = values.get("heads") or max(1, values["dim"] // 64)
        values["kv_heads"] = values.get("kv_heads") or values["heads"]
        values["ffn_dim"] = values.get("ffn_dim") or _swiglu_hidden(values["dim"])
    return ModelSpec.model_validate(values)


def _swiglu_hidden(dim: int) -> int:
    # LLaMA convention: 2/3 of 4*dim, rounded up to a multiple of 8.
    hidden = int(8 * dim / 3)
    return (hidden + 7) // 8 * 8


def resolve(job: SeqTrainJob) -> SeqTrainJob:
    """A copy of the job whose model section is fully explicit (what the trainer and planner read)."""
    out = job.model_copy(deep=True)
    out.spec.model = resolved_model(job)
    return out
