"""Read model weights from anything seqtrain produces or accepts, as one full single-process state dict.

Accepted sources (`load_source(path)`):
- a run folder (`runs/<name>`): its latest complete checkpoint, with the job from the run's trainer config;
- a checkpoint folder (`.../checkpoints/step-N`) of any engine and parallel layout: its `state/` DCP folder,
  consolidated by `seqtrain.parallel.consolidate` (a folder without one is refused unread, naming what it holds);
- a seqtrain export (`seqtrain export`, recognised by its `seqtrain.json`), Hugging Face or seqtrain format;
- a Hugging Face model folder of a family seqtrain's GPT computes (llama, mistral, qwen2, qwen3, gpt2:
  `seqtrain.spec.hf`; `config.json` + `model.safetensors` or a sharded index), read as one even when it also holds
  a meta.json.

Nothing in a source folder is trusted: checkpoint files go through seqtrain.checkpoint.safe_load (no code runs,
unsafe or corrupt files are WeightsError naming the file: exit 2), a sharded index may name only files inside the
folder, and a tokenizer file named by the folder's own records (meta.json, the run's trainer config) is used only
when it lies inside that folder (else `tokenizer["refused"]` says why; export and generate refuse it).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from seqtrain.export.hf_tensors import from_hf, to_hf
from seqtrain.spec import hf
from seqtrain.spec.init_source import local_folder, path_in_hf_cache
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.model import ModelSpec

SEQTRAIN_JSON = "seqtrain.json"
# wrappers that may prefix parameter names (torch.compile, activation checkpointing, DDP-style modules)
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "module.")


class WeightsError(ValueError):
    """A weight source that cannot be read or does not fit; the message names the path or the tensor."""


@dataclass
class Weights:
    spec: ModelSpec  # resolved model section
    state: dict[str, torch.Tensor]  # seqtrain names, full (unsharded) tensors
    tokenizer: dict[str, Any] = field(default_factory=lambda: {"type": "byte"})  # {"type": byte|file, "path"}
    job: SeqTrainJob | None = None  # the job that trained them, when known
    origin: str = ""
    lora: dict[str, Any] | None = None  # LoRA settings when `state` holds unmerged adapters


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


JSON_MAX_BYTES = 64 << 20  # config, index and record files of a model folder: far below this


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from a source folder's file; WeightsError naming it for anything else (unreadable, not JSON,
    not an object, larger than JSON_MAX_BYTES, nested deeper than the parser follows)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(JSON_MAX_BYTES + 1)
    except OSError as exc:
        raise WeightsError(f"{path}: cannot read: {exc.strerror}") from None
    if len(raw) > JSON_MAX_BYTES:
        raise WeightsError(f"{path}: larger than {JSON_MAX_BYTES >> 20} MiB: not a model folder's JSON file")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise WeightsError(f"{path}: not JSON: {(str(exc).splitlines() or [type(exc).__name__])[0][:160]}") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return data


def _load_safetensors_file(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if os.path.islink(path) and not path_in_hf_cache(path):  # the cache's own links into its blobs are its layout
        raise WeightsError(f"{path}: a symbolic link; model files are never followed through links")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise WeightsError(f"{path}: not a readable safetensors file: {str(exc).splitlines()[0][:200]}") from None


def _index_files(index: str) -> list[str]:
    """The shard names of a sharded index: plain file names in the index's folder, nothing else."""
    weight_map = _read_json(index).get("weight_map", {})
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{index}: weight_map is not an object of tensor name -> file name")
    names = set()
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
            raise WeightsError(f"{index}: weight_map[{tensor!r}] = {name!r}: a shard must be a file name in the "
                               "index's own folder (no path, no ..); fix the index")
        names.add(name)
    return sorted(names)


def _read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return _load_safetensors_file(single)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        out: dict[str, torch.Tensor] = {}
        for name in _index_files(index):
            out.update(_load_safetensors_file(os.path.join(folder, name)))
        return out
    raise WeightsError(f"{folder}: no model.safetensors (or model.safetensors.index.json); only safetensors "
                       "weights are read")


def _job_from_run(run_dir: str) -> tuple[SeqTrainJob, str] | None:
    """(resolved job, checkpoint dir) from a run folder's trainer config (latest attempt), if there is one."""
    from seqtrain.spec.runtime import read_trainer_config

    candidates = [os.path.join(run_dir, "trainer-config.json")]
    attempts = glob.glob(os.path.join(run_dir, "attempts", "*", "config.json"))
    candidates += sorted(attempts, key=lambda p: int(os.path.basename(os.path.dirname(p)))
                         if os.path.basename(os.path.dirname(p)).isdigit() else 0, reverse=True)
    for path in candidates:
        if os.path.isfile(path):
            try:
                cfg = read_trainer_config(path)
                return cfg.load_job(), cfg.runtime.checkpoint_dir
            except (OSError, ValueError, RecursionError) as exc:  # pydantic's ValidationError is a ValueError
                raise WeightsError(f"{path}: not a seqtrain trainer config: "
                                   f"{(str(exc).splitlines() or [type(exc).__name__])[0][:160]}") from None
    return None


def _inside(path: str, root: str) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def _tokenizer_of(job: SeqTrainJob, root: str | None = None, named_by: str = "") -> dict[str, Any]:
    """The job's tokenizer. With `root` (the job was read from a folder given to us, `named_by` its file): a
    tokenizer file must lie inside `root`, or be copied there as tokenizer.json; else the entry says why it is
    refused (the folder's records do not get to make seqtrain read or copy a file from elsewhere)."""
    tok = job.spec.data.tokenizer
    if job.spec.data.source == "synthetic":
        return {"type": "synthetic"}
    path = os.path.abspath(os.path.expanduser(tok.path)) if tok.type == "file" and tok.path else ""
    if job.spec.data.source == "tokens":  # `seqtrain prepare-data` folders say how they were tokenized
        for p in job.spec.data.paths:
            index = os.path.join(os.path.expanduser(p), "index.json")
            if os.path.isfile(index):
                described = _read_json(index).get("tokenizer") or {"type": "byte"}
                if not isinstance(described, dict):
                    raise WeightsError(f"{index}: tokenizer is not an object")
                described = dict(described)
                if root is None or described.get("type") != "file":
                    return described
                path = str(described.get("path") or "")
                break
    if path:
        if root is None:
            return {"type": "file", "path": path} if path else {"type": "byte"}
        local = os.path.join(root, "tokenizer.json")
        if os.path.isfile(local) and not os.path.islink(local):
            return {"type": "file", "path": os.path.abspath(local)}
        if path and _inside(path, root):
            return {"type": "file", "path": path}
        return {"type": "file", "path": path, "refused": (
            f"{named_by}: names tokenizer {path}, outside {root}: a folder's own records may not make seqtrain "
            f"read or copy a file from elsewhere; copy the tokenizer to {local} if you trust it")}
    return {"type": "byte"}


def _from_checkpoint(step_dir: str, job: SeqTrainJob | None, records: tuple[str, str] | None = None) -> Weights:
    """`records`: (file, folder) when `job` came from a source folder's own records rather than the caller."""
    from pydantic import ValidationError

    from seqtrain.checkpoint.safe_load import UnusableCheckpoint
    from seqtrain.parallel.consolidate import consolidate, layout_problem
    from seqtrain.spec import resolve

    meta_path = os.path.join(step_dir, "meta.json")
    meta = _read_json(meta_path)
    if not isinstance(meta, dict):
        raise WeightsError(f"{meta_path}: not a checkpoint's meta.json (not an object)")
    # before its job is read: another version's folder may also hold a job this version does not accept
    why = layout_problem(step_dir)
    if why is not None:
        raise WeightsError(why)
    trusted = job is not None and records is None  # a job the caller gave, not the folder's own records
    named_by, root = records or (meta_path, step_dir)
    if job is None and isinstance(meta.get("job"), dict):
        try:
            job = SeqTrainJob.model_validate(meta["job"])
        except ValidationError as exc:
            raise WeightsError(f"{meta_path}: job: not a valid SeqTrainJob ({exc.errors()[0].get('msg')} at "
                               f"{'.'.join(str(x) for x in exc.errors()[0].get('loc', ()))})") from None
    if job is None:
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(step_dir)))
        found = _job_from_run(run_dir)
        job = found[0] if found else None
        named_by, root = f"the trainer config of {run_dir}", run_dir
    if job is None:
        raise WeightsError(f"{step_dir}: the checkpoint does not say which model it holds (no job in meta.json and "
                           "no trainer config in its run folder); export from the run folder instead")
    try:
        job = resolve(job)
    except ValueError as exc:
        raise WeightsError(f"{named_by}: job: {(str(exc).splitlines() or ['invalid'])[0][:200]}") from None
    try:
        state = consolidate(step_dir)
    except UnusableCheckpoint as exc:  # refused or corrupt: the file's fault (CheckpointUnavailable propagates)
        raise WeightsError(str(exc)) from None
    except (FileNotFoundError, KeyError) as exc:
        raise WeightsError(f"{step_dir}: {exc}") from None
    except (TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:  # a file of other contents
        from seqtrain.checkpoint.safe_load import CheckpointUnavailable, classify

        err = classify(step_dir, exc)
        if isinstance(err, CheckpointUnavailable):
            raise err from None
        raise WeightsError(str(err)) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise WeightsError(f"{step_dir}: its model state is not a dict of parameter names to tensors (corrupt or "
                           "not written by seqtrain)")
    state = {_clean_name(k): v.detach().float().cpu().contiguous() for k, v in state.items()}
    spec, state = unpad_vocab(job.spec.model, state)
    lora = getattr(job.spec.model, "lora", None)
    tokenizer = _tokenizer_of(job) if trusted else _tokenizer_of(job, root or step_dir, named_by)
    w = Weights(spec=spec, state=state, tokenizer=tokenizer, job=job, origin=os.path.abspath(step_dir))
    if lora is not None and lora.rank > 0:
        w.lora = lora.to_dict()
    return w


PADDED_ROWS = ("embed.weight", "lm_head.weight")  # the GPT tensors with a row per vocabulary entry


def unpad_vocab(spec: ModelSpec, state: dict[str, torch.Tensor]) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The weights of a run with model.padVocabTo as those of the same model without padding: the pad rows
    dropped (they are never a token), padVocabTo 1. Everything that reads trained weights (export, generate,
    model.init) sees the real vocabulary only."""
    if spec.arch != "gpt" or spec.pad_vocab_to == 1 or not spec.vocab_size:
        return spec, state
    vocab = spec.vocab_size
    state = {k: v[:vocab].contiguous() if k in PADDED_ROWS and v.shape[0] > vocab else v for k, v in state.items()}
    return spec.model_copy(update={"pad_vocab_to": 1}), state


def pad_vocab(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (real vocabulary rows) with zero pad rows appended where `model` (built with model.padVocabTo)
    has more rows; the inverse of `unpad_vocab`."""
    want = model.state_dict()
    out = dict(state)
    for k in PADDED_ROWS:
        v, m = state.get(k), want.get(k)
        if v is not None and m is not None and v.ndim == 2 and v.shape[1] == m.shape[1] and v.shape[0] < m.shape[0] \
                and v.shape[0] == getattr(model, "vocab_size", None):
            out[k] = torch.cat([v, v.new_zeros(m.shape[0] - v.shape[0], v.shape[1])])
    return out


def _seqtrain_info(info_path: str) -> tuple[ModelSpec, dict[str, Any], dict[str, Any]]:
    """(model, tokenizer entry, whole file) of an export's seqtrain.json, its model, LoRA and tokenizer checked."""
    from pydantic import ValidationError

    from seqtrain.spec.model import LoraSpec

    info = _read_json(info_path)
    try:
        spec = ModelSpec.model_validate(info.get("model"))
        if info.get("lora") is not None:
            LoraSpec.model_validate(info["lora"])
    except ValidationError as exc:
        first = exc.errors()[0]
        raise WeightsError(f"{info_path}: {'.'.join(str(x) for x in first.get('loc', ())) or 'model'}: "
                           f"{first.get('msg')}") from None
    tok = info.get("tokenizer") or {}
    if not isinstance(tok, dict) or not isinstance(tok.get("eod"), int | None):
        raise WeightsError(f"{info_path}: tokenizer is not an object with an integer eod")
    return spec, tok, info


def _from_folder(folder: str) -> Weights:
    info_path = os.path.join(folder, SEQTRAIN_JSON)
    tokenizer: dict[str, Any] = {"type": "byte"}
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        tokenizer = {"type": "file", "path": os.path.abspath(os.path.join(folder, "tokenizer.json"))}
    if os.path.isfile(info_path):
        spec, tok, info = _seqtrain_info(info_path)
        if tok.get("type") in ("byte", "synthetic"):
            tokenizer = tok
        elif "eod" in tok:
            tokenizer["eod"] = tok["eod"]
        raw = _read_safetensors(folder)
        if info.get("format") == "hf":
            try:
                state = from_hf(hf.family_of(spec), raw, folder)
            except KeyError as exc:
                raise WeightsError(f"{folder}: {exc.args[0]}") from None
        else:
            state = dict(raw)
        return Weights(spec=spec, state=state, tokenizer=tokenizer, origin=os.path.abspath(folder),
                       lora=info.get("lora"))
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise WeightsError(f"{folder}: neither a run folder, a checkpoint (meta.json), a seqtrain export "
                           "(seqtrain.json) nor a Hugging Face model folder (config.json)")
    cfg = _read_json(cfg_path)
    try:
        spec = hf.spec_from_hf_config(cfg, cfg_path)
    except ValueError as exc:
        raise WeightsError(str(exc)) from None
    try:
        state = from_hf(str(cfg["model_type"]), _read_safetensors(folder), folder)
    except KeyError as exc:
        raise WeightsError(f"{folder}: {exc.args[0]}") from None
    return Weights(spec=spec, state=state, tokenizer=tokenizer, origin=os.path.abspath(folder))


def load_source(path: str, job: SeqTrainJob | None = None) -> Weights:
    """Weights of any accepted source (see the module docstring); `job` names the model when a bare
    checkpoint folder does not."""
    try:
        path = local_folder(path)  # hf://ORG/NAME[@REVISION]: its snapshot in the local Hugging Face cache
    except ValueError as exc:
        raise WeightsError(str(exc)) from None
    if not os.path.isdir(path):
        raise WeightsError(f"{path}: not a folder (give a run folder, a checkpoint step-N folder or a model folder)")
    hf_folder = os.path.isfile(os.path.join(path, "config.json")) and (
        os.path.isfile(os.path.join(path, "model.safetensors"))
        or os.path.isfile(os.path.join(path, "model.safetensors.index.json")))
    if hf_folder or os.path.isfile(os.path.join(path, SEQTRAIN_JSON)):
        return _from_folder(path)  # a model folder by its layout, whatever else lies beside it
    if os.path.isfile(os.path.join(path, "meta.json")):
        return _from_checkpoint(path, job)
    found = _job_from_run(path)
    if found is not None or os.path.isdir(os.path.join(path, "checkpoints")):
        from seqtrain.checkpoint.discovery import latest_checkpoint

        ckpt_dir = found[1] if found and os.path.isdir(found[1]) else os.path.join(path, "checkpoints")
        latest = latest_checkpoint(ckpt_dir)
        if latest is None:
            raise WeightsError(f"{path}: run folder without a complete checkpoint under {ckpt_dir}")
        if job is not None:
            return _from_checkpoint(latest.path, job)
        return _from_checkpoint(latest.path, found[0] if found else None,
                                (f"the trainer config of {path}", path) if found else None)
    return _from_folder(path)


def hf_state(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of the Hugging Face folder of `spec`'s family; WeightsError when no family computes its block."""
    try:
        return to_hf(spec, state)
    except ValueError as exc:
        raise WeightsError(str(exc)) from None


def check_shapes(state: dict[str, torch.Tensor], model: torch.nn.Module, origin: str) -> None:
    """Every tensor of `model` present in `state` with the same shape, and nothing extra; the error names each
    offending tensor."""
    want = {_clean_name(k): v for k, v in model.state_dict().items()}
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    wrong = [f"{k}: {tuple(state[k].shape)} in {origin} but the model has {tuple(v.shape)}"
             for k, v in want.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    lines = wrong + [f"{k}: missing from {origin}" for k in missing] + [f"{k}: not in the model" for k in extra]
    if lines:
        head = lines[:8] + ([f"... and {len(lines) - 8} more"] if len(lines) > 8 else [])
        raise WeightsError("weights do not fit the model:\n  " + "\n  ".join(head))
