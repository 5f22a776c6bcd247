"""The native engine's DDP wrapper: rank logs carry no `broadcast_buffers` FutureWarning (torch 2.13 deprecates the
argument), and DDP still neither broadcasts buffers per step nor at construction (what broadcast_buffers=False has
meant on every torch the project runs). A one-rank gloo group in a fresh process, so the suite's process keeps no
process group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os, sys, warnings
import torch
import torch.distributed as dist
sys.path[:0] = ["trainer"]
from seqtrain.engine.native import NativeEngine
from seqtrain.models import build_model
from seqtrain.runtime.dist import DistContext
from seqtrain.spec import load_job, resolve

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
job = resolve(load_job('''
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: ddp}
spec:
  model: {arch: gpt, vocabSize: 256, dim: 32, layers: 1, heads: 2, ffnDim: 64, maxSeqLen: 16}
  data: {source: builtin, seqLen: 16}
  training: {steps: 2, globalBatchSize: 2, microBatchSize: 1}
'''))
model = build_model(job.spec.model)
import torch.nn.parallel.distributed as ddp_module
synced = []  # DDP's construction-time broadcast: does it take the buffers along?
original = ddp_module._sync_module_states
def spy(*args, **kwargs):
    synced.append(kwargs.get("broadcast_buffers"))
    return original(*args, **kwargs)
ddp_module._sync_module_states = spy
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine = NativeEngine(model, job, DistContext(world_size=1, dp_size=2, backend="gloo"))  # dp 2: wrap in DDP
ddp = engine.wrapped
print(json.dumps({"ddp": type(ddp).__name__, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
                  "forward_sync": bool(getattr(ddp, "forward_sync_buffers", ddp.broadcast_buffers)),
                  "init_sync_buffers": synced}), flush=True)
os._exit(0)  # gloo's threads can abort the interpreter's shutdown (see test_accumulation)
"""


@pytest.mark.slow  # a fresh process
def test_ddp_is_built_without_the_broadcast_buffers_warning_and_syncs_no_buffers(tmp_path) -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "store")], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ddp"] == "DistributedDataParallel"
    assert not [w for w in got["warnings"] if "broadcast_buffers" in w], got["warnings"]
    assert "broadcast_buffers" not in r.stderr
    assert got["forward_sync"] is False  # no per-step broadcast
    assert got["init_sync_buffers"] == [False]  # nor one at construction
