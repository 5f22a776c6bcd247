"""Fill every derived default (preset dims, vocabulary, context length) so later code never guesses."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from seqtrain.spec.data import TokenizerSpec
from seqtrain.spec.datafiles import data_notes
from seqtrain.spec.init_source import describe_init, folder_tokenizer
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.model import ModelSpec
from seqtrain.spec.optimization import auto_note, resolve_fused_projections
from seqtrain.spec.presets import presets_for
from seqtrain.spec.problems import Problem, SpecError

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


# A preset's fields that are a function of its own dim: when the user sets dim, they are derived from it instead.
DIM_BOUND = ("ffn_dim",)
DEFAULT_PRESET = "tiny"
ALIASES = {"vocab_size": "vocabSize", "kv_heads": "kvHeads", "ffn_dim": "ffnDim", "max_seq_len": "maxSeqLen"}


@dataclass(frozen=True)
class ResolvedModel:
    """The model section made explicit, and per field where its value came from (what `plan`/`validate` show)."""

    model: ModelSpec
    origin: dict[str, str]

    def derivations(self) -> str:
        """One line: every shape field with its value and origin, e.g. `ffnDim 344 (from dim: ...)`."""
        m = self.model
        names = ("dim", "layers", "heads", "kv_heads", "ffn_dim") if m.arch == "gpt" else ("dim", "layers")
        parts = [f"{ALIASES.get(k, k)} {getattr(m, k)} ({self.origin.get(k, 'set')})"
                 for k in (*names, "vocab_size", "max_seq_len")]
        return f"model {m.arch}: " + ", ".join(parts)


def resolve_model(job: SeqTrainJob) -> ResolvedModel:
    """The model section with the preset and defaults applied (explicit fields win), with each field's origin.

    Precedence: explicit fields, then the weights of model.init, then the preset (named, else the default `tiny`:
    the origin says which). A preset's ffnDim applies only with the preset's own dim; with a dim the user set it is
    derived from it (ffnDim by the SwiGLU rule the presets follow). SpecError for a preset
    the arch does not have.
    """
    m = job.spec.model
    values = m.model_dump()
    explicit = {k for k in m.model_fields_set if values.get(k) is not None}
    origin = {k: "set" for k in explicit}
    source = describe_init(m.init) if m.init and paths_readable() else None
    if source and "arch" not in explicit:
        values["arch"] = source["arch"]
    arch = values["arch"]
    presets = presets_for(arch)
    preset_name, label = m.preset, f"preset {m.preset}"
    if m.preset is not None and m.preset not in presets:
        raise SpecError([Problem("spec.model.preset", f"{m.preset!r} is not a preset of arch {arch}; use one of "
                                                      f"{', '.join(presets)}, or remove it and set the dims")])
    if preset_name is None and m.init and source is None:
        # model.init not readable here (the operator; or a folder that is not there yet, which validate reports):
        # placeholder dims so the rest of the checks run; the trainer takes the real ones from the weights.
        preset_name, label = DEFAULT_PRESET, f"preset {DEFAULT_PRESET} as a placeholder until model.init is read"
    elif preset_name is None and not source:
        preset_name, label = DEFAULT_PRESET, f"default preset {DEFAULT_PRESET}"
    for key, val in (presets.get(preset_name, {}) if preset_name else {}).items():
        if key in DIM_BOUND and ("dim" in explicit or values.get("mlp") in ("gelu", "gelu-exact")):
            continue  # the preset's (SwiGLU) MLP width belongs to its dim; derived from the model's own below
        if key not in explicit:
            values[key], origin[key] = val, label
    for key, val in (source or {}).items():  # the weights fix the shapes; explicit fields are checked against them
        if key not in explicit:
            values[key], origin[key] = val, "model.init"
    if values.get("dim") is None or values.get("layers") is None:  # a weight source that names no dims
        raise SpecError([Problem("spec.model.init", f"{m.init!r} does not say the model's dim and layers; set "
                                                    "model.preset, or model.dim and model.layers, as it was trained")])
    if values.get("vocab_size") is None:
        vocab, why = tokenizer_vocab(job)
        values["vocab_size"], origin["vocab_size"] = (vocab, why) if vocab else (BYTE_VOCAB, "byte-level default")
    if values.get("max_seq_len") is None:
        values["max_seq_len"], origin["max_seq_len"] = job.spec.data.seq_len, "data.seqLen"
    if arch == "gpt":
        dim = values["dim"]
        if values.get("heads") is None:
            values["heads"], origin["heads"] = max(1, dim // 64), f"from dim {dim}: heads of 64"
        if values.get("kv_heads") is None:
            values["kv_heads"], origin["kv_heads"] = values["heads"], "= heads"
        if values.get("ffn_dim") is None and values.get("mlp") in ("gelu", "gelu-exact"):  # GPT-2's MLP
            values["ffn_dim"], origin["ffn_dim"] = 4 * dim, f"from dim {dim}: 4 x dim (mlp {values['mlp']})"
        elif values.get("ffn_dim") is None:
            values["ffn_dim"] = swiglu_hidden(dim)
            origin["ffn_dim"] = f"from dim {dim}: 8/3 x dim rounded up to a multiple of {ffn_multiple(dim)}"
    return ResolvedModel(ModelSpec.model_validate(values), origin)


def tokenizer_vocab(job: SeqTrainJob) -> tuple[int | None, str]:
    """The data's vocabulary (None: not known here) and where it comes from, in words."""
    d = job.spec.data
    size = tokenizer_vocab_size(job)
    if d.source == "synthetic":
        return size, f"data.synthetic.vocab {d.synthetic.vocab} + 4 markers"
    if d.source == "tokens" and paths_readable() and _prepared_vocab(d.paths) is not None:
        return size, "the prepared data's index.json"
    if d.source == "tokens" and d.tokenizer.type == "byte":
        return size, "byte-level default; raw token files carry no vocabulary: set model.vocabSize"
    return size, "data.tokenizer" if d.tokenizer.type != "byte" else "byte-level tokenizer"


def resolved_model(job: SeqTrainJob) -> ModelSpec:
    """The model section with the preset and defaults applied (explicit fields win)."""
    return resolve_model(job).model


def ffn_multiple(dim: int) -> int:
    """What the MLP width is rounded up to: 8 below dim 1024 (tiny, mini, small, 125m), LLaMA's 256 from there
    (350m, 1b). Together with `swiglu_hidden` this reproduces every GPT preset's ffn_dim (a unit test checks)."""
    return 256 if dim >= 1024 else 8


def swiglu_hidden(dim: int) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4*dim (the same parameters as a 4*dim GELU MLP), rounded up."""
    hidden, mult = int(8 * dim / 3), ffn_multiple(dim)
    return (hidden + mult - 1) // mult * mult


def vocab_conflict(job: SeqTrainJob) -> Problem | None:
    """The one vocabulary rule: the model's vocabulary holds every id of the data. When model.init's weights fix
    the vocabulary and the data needs more ids, no model.vocabSize can satisfy both (the two separate messages
    sent a user from "use at least 257" to "set it to 256" and back): say so once, with the fixes that work."""
    m, d = job.spec.model, job.spec.data
    if not m.init or not paths_readable() or d.source != "tokens":
        return None
    have = (describe_init(m.init) or {}).get("vocab_size")
    need = _prepared_vocab(d.paths)
    if have is None or need is None or need <= have:
        return None
    byte = (tokenizer_of_prepared(d.paths) or {}).get("type") == "byte"
    fix = ("prepare-data's byte tokenizer adds an end-of-document id 256 that a byte model does not have: train "
           "on the text with data.source text (byte documents end with NUL, id 0), or"
           if byte else "prepare the data with the model's own tokenizer (seqtrain prepare-data --tokenizer "
           "<its tokenizer.json>), or")
    return Problem("spec.model.init", f"its weights have {have} token ids but the prepared data in data.paths uses "
                                      f"{need} (end-of-document id included), and the weights fix the vocabulary "
                                      f"(model.vocabSize cannot change it); {fix} train from scratch without "
                                      "model.init")


def tokenizer_of_prepared(paths: list[str]) -> dict | None:
    """The tokenizer record of the first `seqtrain prepare-data` folder in paths (its index.json)."""
    for p in paths:
        try:
            with open(os.path.join(os.path.expanduser(p), "index.json"), encoding="utf-8") as f:
                tok = json.load(f).get("tokenizer")
        except (OSError, ValueError, AttributeError):
            continue
        return tok if isinstance(tok, dict) else None
    return None


def job_notes(job: SeqTrainJob) -> list[str]:
    """What `validate` and `plan` print beside a valid job: the model's derived fields with their origins, and
    warnings that are not errors (training data named like held-out data)."""
    opt = job.spec.optimization
    fused = resolve_fused_projections(opt)[1] if opt.fused_projections == "auto" else ""
    auto = auto_note(opt.precision, opt.compile, job.spec.resources.gpus, fused)
    return [resolve_model(job).derivations(), *([auto] if auto else []), *data_notes(job, paths_readable())]


def resolve(job: SeqTrainJob) -> SeqTrainJob:
    """A copy of the job whose model section is fully explicit (what the trainer and planner read), and whose data
    tokenizer is the model.init folder's when the spec names none (`init_tokenizer`)."""
    out = job.model_copy(deep=True)
    out.spec.model = resolved_model(job)
    if (path := init_tokenizer(job)) is not None:
        out.spec.data.tokenizer = TokenizerSpec(type="file", path=path)
    return out


def init_tokenizer(job: SeqTrainJob) -> str | None:
    """The model.init folder's tokenizer.json when the job trains text with the tokenizer left unset: a model is
    fine-tuned with its own tokenizer unless data.tokenizer names another (byte ids into a Llama's embedding would
    train, and report success, on the wrong tokens)."""
    d, init = job.spec.data, job.spec.model.init
    if not init or ("://" in init and not init.startswith("hf://")) or not paths_readable() \
            or "tokenizer" in d.model_fields_set:
        return None
    if d.source == "synthetic" or (d.source == "tokens" and _prepared_vocab(d.paths) is not None):
        return None  # ids fixed by the task / by prepare-data's own tokenizer
    return folder_tokenizer(init)
