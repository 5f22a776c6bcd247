"""Turn a seqtrain checkpoint into one plain state dict of the full model (fp32, single-process names).

    python -m seqtrain.parallel.consolidate CHECKPOINTS/step-N OUT.pt

Every engine writes the layout-independent DCP folder `state/` (seqtrain.checkpoint.dcp_format), keyed by the
single-process parameter names with full-shape tensors, so this is DCP's load in memory through seqtrain's
restricted readers. A step folder without `state/` is refused unread in one line naming what it holds. The result
loads with `model.load_state_dict(sd, strict=True)` into `seqtrain.models.build_model(spec)`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

import torch

from seqtrain.checkpoint.safe_load import CheckpointUnavailable, UnusableCheckpoint, dcp_load

# seqtrain's small files beside `state/`: what a step folder holds in this layout, named only when nothing else is
_OWN_FILES = re.compile(r"^(meta\.json|trainer\.pt|rng-rank\d+\.pt)$")


def _printable(name: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in name[:80])  # a planted name must not break the line


def layout_problem(step_dir: str) -> str | None:
    """Why the published checkpoint `step_dir` is not in the layout this version reads (a `state/` DCP folder), or
    None. Lists the folder only: nothing in it is opened."""
    from seqtrain.checkpoint import dcp_format

    if dcp_format.has_state(step_dir):
        return None
    try:
        entries = sorted(os.scandir(step_dir), key=lambda e: e.name)
    except OSError as exc:
        return f"{step_dir}: cannot list it: {exc.strerror}"
    names = [_printable(e.name) + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries
             if not _OWN_FILES.match(e.name)]
    found = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "") if names else \
        f"no {dcp_format.STATE_DIR}/ folder"
    return (f"{step_dir} holds a checkpoint layout this version does not read ({found}); re-run it with this "
            "version or export it with the seqtrain that wrote it")


def _from_dcp(folder: str) -> dict[str, torch.Tensor]:
    # dcp_to_torch_save's load, in memory, with seqtrain's readers: .metadata through the restricted Unpickler,
    # byte items through the weights_only torch.load (DCP's own readers unpickle both fully)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    dcp_load(folder, lambda reader: _load_state_dict(state, storage_reader=reader,
                                                     planner=_EmptyStateDictLoadPlanner(), no_dist=True))
    return {k: v for k, v in state["model"].items()}


def consolidate(step_dir: str) -> dict[str, torch.Tensor]:
    """The full model's state dict from one published checkpoint folder; every file goes through
    seqtrain.checkpoint.safe_load (UnusableCheckpoint / CheckpointUnavailable name the file)."""
    from seqtrain.checkpoint import dcp_format
    from seqtrain.checkpoint.discovery import problem

    if not os.path.isfile(os.path.join(step_dir, "meta.json")):
        raise FileNotFoundError(f"{step_dir}: no meta.json, not a complete checkpoint")
    why = problem(step_dir, require_step_name=False) or layout_problem(step_dir)
    if why is not None:
        raise UnusableCheckpoint(why)
    return _from_dcp(os.path.join(step_dir, dcp_format.STATE_DIR))


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
