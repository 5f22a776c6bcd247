"""Spec values that are valid but not implemented yet: rejected with a clear message instead of ignored.

Each entry names the field, the value and what works today. Remove an entry when its feature lands.
"""

from __future__ import annotations

from collections.abc import Callable

from .job import SeqTrainJob
from .problems import Problem

# (field path, predicate that is True when the job asks for the missing feature, message)
_Check = tuple[str, Callable[[SeqTrainJob], bool], str]

_UNAVAILABLE: list[_Check] = [
    ("spec.optimization.zero.stage", lambda j: j.spec.optimization.zero.stage > 0,
     "ZeRO stages 1-3 are not available yet; use 0 (plain data parallel)"),
    ("spec.optimization.zero.offload", lambda j: j.spec.optimization.zero.offload != "none",
     "optimizer offload is not available yet; use none"),
    ("spec.optimization.engine", lambda j: j.spec.optimization.engine == "deepspeed",
     "the DeepSpeed engine is not available yet; use auto or native"),
    ("spec.optimization.tensorParallel", lambda j: j.spec.optimization.tensor_parallel > 1,
     "tensor parallelism is not available yet; use 1"),
    ("spec.optimization.pipelineParallel", lambda j: j.spec.optimization.pipeline_parallel > 1,
     "pipeline parallelism is not available yet; use 1"),
    ("spec.optimization.sequenceParallel", lambda j: j.spec.optimization.sequence_parallel,
     "sequence parallelism is not available yet; use false"),
    ("spec.optimization.gradCompression", lambda j: j.spec.optimization.grad_compression != "none",
     "gradient compression is not available yet; use none"),
    ("spec.optimization.kernels", lambda j: bool(j.spec.optimization.kernels),
     "custom kernels are not wired into the models yet; leave unset or false"),
]


def unavailable(job: SeqTrainJob) -> list[Problem]:
    return [Problem(path, msg) for path, wants, msg in _UNAVAILABLE if wants(job)]
