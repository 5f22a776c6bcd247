"""Does the memory estimate fit what the job asks for? `seqtrain plan` exits 2 when it does not (a job that cannot
fit is an invalid input, caught before any node is tied up), naming the fields that would change the answer."""

from __future__ import annotations

import re

from seqtrain.spec import SeqTrainJob
from seqtrain.spec.problems import Problem
from seqtrain_operator.planner.inventory import memory_bytes
from seqtrain_operator.planner.memory import MemoryEstimate, gib

# GPU memory from the product label (`NVIDIA-H100-80GB-HBM3`, `NVIDIA-A100-SXM4-40GB`): the only place a spec
# states it. Without a size in the name nothing is claimed.
_GB = re.compile(r"(\d+)GB", re.IGNORECASE)
_LOWER = ("lower data.seqLen or training.microBatchSize, set optimization.activationCheckpointing.policy, a "
          "higher optimization.zero.stage, or more replicas / tensorParallel / pipelineParallel")


def gpu_memory_bytes(product: str | None) -> int | None:
    m = _GB.search(product or "")
    return int(m.group(1)) * 10**9 if m else None


def memory_problems(job: SeqTrainJob, est: MemoryEstimate) -> list[Problem]:
    r = job.spec.resources
    procs = r.procs
    device = max(s.total for s in est.stages)
    host_per_rank = max(s.cpu + (s.total if r.gpus == 0 else 0) for s in est.stages)
    out = []
    limit = memory_bytes(r.memory)
    if host_per_rank * procs > limit:
        where = "the CPU" if r.gpus == 0 else "host memory (offloaded states)"
        out.append(Problem("spec.resources.memory", f"the estimate needs {gib(host_per_rank * procs)} of {where} per "
                           f"replica ({procs} rank(s) x {gib(host_per_rank)}), more than resources.memory "
                           f"{r.memory}: raise resources.memory, or {_LOWER}"))
    gpu = gpu_memory_bytes(r.gpu_product) if r.gpus > 0 else None
    if gpu is not None and device > gpu:
        out.append(Problem("spec.resources.gpuProduct", f"the estimate needs {gib(device)} per GPU, more than the "
                           f"{gib(gpu)} of {r.gpu_product}: {_LOWER}, or optimization.zero.offload: cpu"))
    return out
