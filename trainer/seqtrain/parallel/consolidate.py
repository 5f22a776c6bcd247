"""Turn any seqtrain checkpoint into one plain state dict of the full model (fp32, single-process names).

    python -m seqtrain.parallel.consolidate CHECKPOINTS/step-N OUT.pt

Handles every engine's layout: the layout-independent DCP folder `state/` (seqtrain.checkpoint.dcp_format, what
native, FSDP2 and DeepSpeed write today), and those of checkpoints written before it: DeepSpeed ZeRO 1-3 shards (`zero/`, through DeepSpeed's zero_to_fp32),
FSDP2 DCP folders (`fsdp/`, `fsdp-tp<i>/`), tensor/pipeline shard files (`engine-pp<p>-tp<t>.pt`) and the
replicated `engine.pt`. Tensor-parallel slices are concatenated back (column-parallel rows, row-parallel
columns, vocabulary rows), pipeline stages are merged and the last stage's tied-embedding copy dropped.
The result loads with `model.load_state_dict(sd, strict=True)` into `seqtrain.models.build_model(spec)`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections.abc import Sequence

import torch

from seqtrain.checkpoint.safe_load import (
    CheckpointUnavailable,
    UnusableCheckpoint,
    dcp_load,
    load_plain,
    restricted_loads,
)

# tensor-parallel slicing per parameter name: dim 0 (column parallel, vocabulary rows) or dim 1 (row parallel)
_ROW_SPLIT = re.compile(r"(attn\.(q|k|v)|mlp\.(gate|up))\.(weight|bias)$|^(embed|lm_head)\.weight$")
_COL_SPLIT = re.compile(r"(attn\.out|mlp\.down)\.weight$")


def _meta(step_dir: str) -> dict:
    with open(os.path.join(step_dir, "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def _merge_tp(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if len(shards) == 1:
        return shards[0]
    out = {}
    for name, first in shards[0].items():
        if _ROW_SPLIT.search(name):
            out[name] = torch.cat([s[name] for s in shards], dim=0)
        elif _COL_SPLIT.search(name):
            out[name] = torch.cat([s[name] for s in shards], dim=1)
        else:
            out[name] = first  # replicated (norms)
    return out


def _from_shard_files(step_dir: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(step_dir, "engine-pp*-tp*.pt")))
    by_tp: dict[int, list[dict[str, torch.Tensor]]] = {}
    for path in files:
        pp, tp = map(int, re.findall(r"pp(\d+)-tp(\d+)", path)[0])
        model = load_plain(path)["model"]
        merged: dict[str, torch.Tensor] = {}
        for name, t in model.items():
            m = re.match(r"stage\d+\.(.*)$", name)
            local = m.group(1) if m else name
            if local == "output.weight":
                continue  # the last stage's copy of the tied embedding
            merged[local] = t
        by_tp.setdefault(tp, []).append(merged)
    per_tp = []
    for tp in sorted(by_tp):
        whole: dict[str, torch.Tensor] = {}
        for part in by_tp[tp]:
            whole.update(part)
        per_tp.append(whole)
    return _merge_tp(per_tp)


def _from_dcp(folder: str) -> dict[str, torch.Tensor]:
    # dcp_to_torch_save's load, in memory, with seqtrain's readers: .metadata through the restricted Unpickler,
    # byte items through the weights_only torch.load (DCP's own readers unpickle both fully)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    dcp_load(folder, lambda reader: _load_state_dict(state, storage_reader=reader,
                                                     planner=_EmptyStateDictLoadPlanner(), no_dist=True))
    return {k: v for k, v in state["model"].items()}


def _from_deepspeed(step_dir: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with restricted_loads(os.path.join(step_dir, "zero")):  # DeepSpeed's torch.load(weights_only=False), held
        sd = get_fp32_state_dict_from_zero_checkpoint(step_dir, tag="zero")
    # DeepSpeed wrapped the loss module, whose only child is the model
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}


def _layout_error(step_dir: str, engine: object, want: str) -> UnusableCheckpoint:
    return UnusableCheckpoint(f"{step_dir}: meta.json says engine {engine!r}, but the folder has no {want}: not a "
                              "checkpoint of that engine (only a folder whose layout matches its meta.json is read)")


def consolidate(step_dir: str) -> dict[str, torch.Tensor]:
    """The full model's state dict from one published checkpoint folder. The engine named in its meta.json picks
    the files read, and they must be there (a folder is a checkpoint only when its layout says so); every file
    goes through seqtrain.checkpoint.safe_load (UnusableCheckpoint / CheckpointUnavailable name the file)."""
    from seqtrain.checkpoint.discovery import problem

    if not os.path.isfile(os.path.join(step_dir, "meta.json")):
        raise FileNotFoundError(f"{step_dir}: no meta.json, not a complete checkpoint")
    why = problem(step_dir, require_step_name=False)
    if why is not None:
        raise UnusableCheckpoint(why)
    from seqtrain.checkpoint import dcp_format

    if dcp_format.has_state(step_dir):  # any engine: single-process names and full shapes already
        return _from_dcp(os.path.join(step_dir, dcp_format.STATE_DIR))
    engine = _meta(step_dir).get("engine")
    if engine == "deepspeed":
        if not os.path.isdir(os.path.join(step_dir, "zero")):
            raise _layout_error(step_dir, engine, "zero/ folder")
        return _from_deepspeed(step_dir)
    if engine == "fsdp2":
        dcp_dirs = [d for d in sorted(glob.glob(os.path.join(step_dir, "fsdp*"))) if os.path.isdir(d)
                    and re.fullmatch(r"fsdp(-tp\d+)?", os.path.basename(d))]
        if not dcp_dirs:
            raise _layout_error(step_dir, engine, "fsdp/ or fsdp-tp<i>/ folder")
        return _merge_tp([_from_dcp(d) for d in sorted(dcp_dirs, key=lambda d: int(d.rsplit("tp", 1)[-1])
                                                       if "-tp" in d else 0)])
    if glob.glob(os.path.join(step_dir, "engine-pp*-tp*.pt")):
        return _from_shard_files(step_dir)
    path = os.path.join(step_dir, "engine.pt")
    if os.path.isfile(path):
        return load_plain(path)["model"]
    raise FileNotFoundError(f"{step_dir}: no engine files found (meta.json says engine {engine})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqtrain.parallel.consolidate",
                                description="write a checkpoint's full model as one plain fp32 state dict")
    p.add_argument("step_dir", help="a published checkpoint folder, e.g. runs/job/checkpoints/step-200")
    p.add_argument("out", help="output file (torch.save of the state dict)")
    args = p.parse_args(argv)
    try:
        sd = consolidate(args.step_dir)
    except (FileNotFoundError, KeyError, ValueError, UnusableCheckpoint, CheckpointUnavailable) as exc:
        print(f"consolidate: {exc}", file=sys.stderr)
        return 2
    sd = {k: v.detach().float().cpu().contiguous() for k, v in sd.items()}
    torch.save(sd, args.out)
    n = sum(v.numel() for v in sd.values())
    print(f"{args.out}: {len(sd)} tensors, {n:,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
