"""What model a `model.init` source holds, read from its JSON files only (torch-free: validation and the
webhook call it). Weights themselves are read by `seqtrain.export.weights` in the trainer."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

# fields a weight source fixes; the job may not contradict them (the rest: dropout, init, maxSeqLen are free;
# maxSeqLen is the size of a learned position table, so described, and fixed, only for positions learned)
SHAPE_FIELDS = ("arch", "vocab_size", "dim", "layers", "heads", "kv_heads", "ffn_dim", "tie_embeddings", "head_dim",
                "norm", "norm_bias", "mlp", "positions", "qkv_bias", "out_bias", "mlp_bias", "qk_norm", "max_seq_len")
# change the function, not the shapes: taken over unless set
FUNCTION_FIELDS = ("rope_theta", "norm_eps", "rope_scaling", "sliding_window")


HF_SCHEME = "hf://"


def hf_snapshot(uri: str) -> tuple[str, str]:
    """(snapshot folder, repository folder) of `hf://ORG/NAME[@REVISION]` in the local Hugging Face cache, laid out
    as huggingface_hub lays it: $HF_HUB_CACHE or $HF_HOME/hub (default ~/.cache/huggingface/hub), then
    models--ORG--NAME/refs/<branch or tag> holding a commit, and snapshots/<commit>/ whose files link into
    ../../blobs. Offline: nothing is downloaded. ValueError saying what is missing and how to get it."""
    name, _, rev = uri[len(HF_SCHEME):].partition("@")
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") or os.sep in p for p in parts):
        raise ValueError(f"{uri!r} is not hf://ORG/NAME[@REVISION]")
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    repo = os.path.join(hub, f"models--{parts[0]}--{parts[1]}")
    fetch = f"download it once where the hub is reachable: huggingface-cli download {name}" + (
        f" --revision {rev}" if rev else "")
    if not os.path.isdir(repo):
        raise ValueError(f"{uri}: not in the local Hugging Face cache ({repo} does not exist); {fetch}")
    rev = rev or "main"
    commit = rev
    ref = os.path.join(repo, "refs", rev)
    if os.sep not in rev and os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    snapshot = os.path.join(repo, "snapshots", commit)
    if os.sep in commit or commit in (".", "..") or not os.path.isdir(snapshot):
        raise ValueError(f"{uri}: revision {rev!r} is not in the local Hugging Face cache ({repo}/refs/{rev} or "
                         f"snapshots/{commit}); {fetch}")
    return snapshot, repo


# Set in a Kubernetes job's pods: the folder on the checkpoint volume that the job's init container downloaded
# hf:// models into (seqtrain.hub.download lays them out as ORG--NAME/<revision> with a marker written last).
HF_DIR_ENV = "SEQTRAIN_HF_DIR"


def hf_downloaded(uri: str) -> str | None:
    """The complete download of `uri` below $SEQTRAIN_HF_DIR, or None (not set, or not downloaded there)."""
    root = os.environ.get(HF_DIR_ENV)
    if not root:
        return None
    from seqtrain.hub.download import HubError, HubModel, complete

    try:
        model = HubModel.parse(uri)
    except HubError:
        return None
    folder = model.folder(root)
    return folder if complete(folder, model) else None


def local_folder(path: str) -> str:
    """The folder a `model.init` value names here: hf://ORG/NAME[@REVISION] -> the job's download on the checkpoint
    volume (in its pods), else its cached snapshot (ValueError when it is not cached); anything else -> the path
    itself."""
    if not path.startswith(HF_SCHEME):
        return os.path.expanduser(path)
    if (done := hf_downloaded(path)) is not None:
        return done
    try:
        return hf_snapshot(path)[0]
    except ValueError:
        if os.environ.get(HF_DIR_ENV):  # in a job's pod: the init container's download is where it would be
            raise ValueError(f"{path}: not downloaded into {os.environ[HF_DIR_ENV]} (the job's hf-download init "
                             "container writes it there before the ranks start; see its log)") from None
        raise


def _json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):  # a nested document the json module cannot read is not a model's
        return None
    return data if isinstance(data, dict) else None


def _model_of_job(job: dict[str, Any]) -> dict[str, Any] | None:
    from seqtrain.spec.model import ModelSpec

    model = (job.get("spec") or {}).get("model")
    if not isinstance(model, dict):
        return None
    try:
        return ModelSpec.model_validate(model).model_dump()
    except ValueError:
        return None


def describe_init(path: str) -> dict[str, Any] | None:
    """Model fields (snake_case) of the weights at `path`, or None when they cannot be read here (a path that
    exists only inside the cluster's pods, say)."""
    try:
        path = local_folder(path)
    except ValueError:
        return None
    if not os.path.isdir(path):
        return None
    info = _json(os.path.join(path, "seqtrain.json"))
    if info and isinstance(info.get("model"), dict):
        from seqtrain.spec.model import ModelSpec

        fields = ModelSpec.model_validate(info["model"]).model_dump()
    elif (meta := _json(os.path.join(path, "meta.json"))) is not None:
        fields = _model_of_job(meta["job"]) if isinstance(meta.get("job"), dict) else None
    elif (cfg := _json(os.path.join(path, "config.json"))) is not None and "job" not in cfg:
        from seqtrain.spec.hf import spec_from_hf_config

        try:
            fields = spec_from_hf_config(cfg, os.path.join(path, "config.json")).model_dump()
        except (ValueError, KeyError):
            return None
    else:  # a run folder: its trainer config names the job
        configs = [os.path.join(path, "trainer-config.json")]
        configs += sorted(glob.glob(os.path.join(path, "attempts", "*", "config.json")), reverse=True)
        fields = None
        for c in configs:
            if (data := _json(c)) and isinstance(data.get("job"), dict):
                fields = _model_of_job(data["job"])
                break
    if not fields:
        return None
    if fields.get("positions") != "learned":
        fields = {**fields, "max_seq_len": None}
    if fields.get("arch") == "gpt" and fields.get("norm") == "layernorm" and fields.get("norm_bias") is None:
        # normBias unset is the norm's own default: a LayerNorm with a bias (GPT-2; every seqtrain model written
        # before normBias existed). Said explicitly, so a job's normBias false is refused against these weights.
        fields = {**fields, "norm_bias": True}
    # head_dim None is dim / heads, sliding_window and rope_scaling None are "none": values the job must not override
    keep_none = ("head_dim", "sliding_window", "rope_scaling") if fields.get("arch") == "gpt" else ()
    return {k: fields.get(k) for k in (*SHAPE_FIELDS, *FUNCTION_FIELDS)
            if fields.get(k) is not None or k in keep_none}


def init_refusal(path: str) -> str | None:
    """Why the folder at `path` cannot start a model (its config.json names a key seqtrain cannot represent, or
    no file describes a model, or an hf:// model is not in the local cache), or None when `describe_init` reads
    it or the folder is not here."""
    try:
        path = local_folder(path)
    except ValueError as exc:
        return str(exc)
    if not os.path.isdir(path) or describe_init(path) is not None:
        return None
    cfg_path = os.path.join(path, "config.json")
    if os.path.isfile(cfg_path) and not os.path.isfile(os.path.join(path, "seqtrain.json")):
        cfg = _json(cfg_path)
        if cfg is None:
            return f"{cfg_path}: not a JSON object"
        if "job" not in cfg:
            from seqtrain.spec.hf import spec_from_hf_config

            try:
                spec_from_hf_config(cfg, cfg_path)
            except ValueError as exc:
                return str(exc)
    return None


# Files beside a tokenizer.json that transformers' AutoTokenizer reads: special tokens, chat template. They travel
# with the tokenizer (the run folder's copy, an export).
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def folder_tokenizer(path: str) -> str | None:
    """The tokenizer.json a `model.init` folder brings (a Hugging Face folder's, or an export's written by a run
    that trained with it), or None: none there, or the folder's own records say it trained on bytes."""
    try:
        path = local_folder(path)
    except ValueError:
        return None
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok) or (os.path.islink(tok) and not path_in_hf_cache(tok)):
        return None
    info = _json(os.path.join(path, "seqtrain.json"))
    if info and (info.get("tokenizer") or {}).get("type") in ("byte", "synthetic"):
        return None
    return os.path.abspath(tok)


def path_in_hf_cache(path: str) -> bool:
    """Whether `path` is a file of a cached snapshot (models--ORG--NAME/snapshots/<rev>/...) that resolves inside
    that repository's own folder: the cache's links into ../../blobs are its layout, any other link is refused."""
    snapshot = os.path.dirname(os.path.abspath(path))
    repo = os.path.dirname(os.path.dirname(snapshot))
    if os.path.basename(os.path.dirname(snapshot)) != "snapshots" or not os.path.basename(repo).startswith("models--"):
        return False
    real, top = os.path.realpath(path), os.path.realpath(repo)
    return real.startswith(top.rstrip(os.sep) + os.sep)


def tensor_hint(field: str, desc: dict[str, Any]) -> str:
    """A tensor of the source whose shape shows `field` (for error messages)."""
    d, v = desc.get("dim"), desc.get("vocab_size")
    if field in ("dim", "vocab_size"):
        return f"embed.weight is [{v}, {d}]"
    if field == "ffn_dim":
        return f"blocks.0.mlp.gate.weight is [{desc.get('ffn_dim')}, {d}]"
    if field in ("heads", "kv_heads") and desc.get("heads") and d:
        hd = d // desc["heads"]
        return f"blocks.0.attn.k.weight is [{(desc.get('kv_heads') or desc['heads']) * hd}, {d}]"
    if field == "layers":
        return f"blocks.0 .. blocks.{(desc.get('layers') or 1) - 1}"
    if field == "tie_embeddings":
        return "lm_head.weight is " + ("absent (tied)" if desc.get("tie_embeddings") else "present (untied)")
    if field == "max_seq_len":
        return f"pos_embed.weight is [{desc.get('max_seq_len')}, {d}]"
    if field == "norm_bias":
        return "blocks.0.attn_norm.bias is " + ("present" if desc.get("norm_bias") else "absent")
    if field in desc and field != "arch":
        return f"its {field} is {desc[field]!r}"
    return f"arch {desc.get('arch')}"
