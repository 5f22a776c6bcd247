"""Elastic gangs (spec.minReplicas): the gang sizes a job may run at, and why a setting cannot work.

An attempt of an elastic job runs `with_replicas(n)` of the job for one n of `sizes(job)`: the same global batch over
fewer data-parallel ranks (more accumulation), resumed from a checkpoint written at another size. Every engine's
checkpoint reshards over a data-parallel change: native DDP, tensor and pipeline parallel, FSDP2 (with or without
tensor parallel) and DeepSpeed ZeRO write the layout-independent DCP format (seqtrain.checkpoint.dcp_format), the
only one read.
"""

from __future__ import annotations

from seqtrain.layout.rules import parallel_problems
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.model import ModelSpec
from seqtrain.spec.problems import Problem
from seqtrain.spec.resolve import resolved_model


def divisors_hint(n: int, limit: int = 6) -> str:
    return ", ".join(str(d) for d in [d for d in range(1, n + 1) if n % d == 0][:limit])


def size_problems(job: SeqTrainJob, m: ModelSpec) -> list[Problem]:
    """What the gang's size decides: the world must split into tensor x pipeline groups, the global batch into
    micro-batches over the data-parallel ranks, and the parallel layout must suit the model. `m`: the resolved
    model."""
    s, opt, tr = job.spec, job.spec.optimization, job.spec.training
    out: list[Problem] = []
    world = s.world_size
    model_par = opt.tensor_parallel * opt.pipeline_parallel
    if world % model_par != 0:
        out.append(Problem("spec.optimization.tensorParallel",
                           f"tensorParallel x pipelineParallel = {model_par} must divide the world size {world} "
                           f"(replicas x processesPerReplica); divisors of {world}: {divisors_hint(world)}"))
    per_step = tr.micro_batch_size * s.dp
    if tr.global_batch_size < per_step:
        out.append(Problem("spec.training.globalBatchSize",
                           f"{tr.global_batch_size} sequences cannot feed {s.dp} data-parallel ranks x "
                           f"microBatchSize {tr.micro_batch_size}; use at least {per_step} or lower "
                           "training.microBatchSize"))
    elif tr.global_batch_size % per_step != 0:
        lo = tr.global_batch_size // per_step * per_step
        out.append(Problem("spec.training.globalBatchSize",
                           f"must be a multiple of microBatchSize x data-parallel ranks = {per_step} "
                           f"(e.g. {lo} or {lo + per_step})"))
    out += [Problem(r.path, r.message) for r in parallel_problems(job, m)]
    return out


def sizes(job: SeqTrainJob) -> tuple[int, ...]:
    """The replica counts an attempt may run with, largest first: `replicas`, then (elastic jobs) each smaller count
    down to minReplicas at which the layout still works."""
    s = job.spec
    if not s.elastic:
        return (s.replicas,)
    assert s.min_replicas is not None
    m = resolved_model(job)
    smaller = tuple(n for n in range(s.replicas - 1, s.min_replicas - 1, -1)
                    if not size_problems(job.with_replicas(n), m))
    return (s.replicas, *smaller)


def elastic_problems(job: SeqTrainJob, m: ModelSpec) -> list[Problem]:
    s = job.spec
    if s.min_replicas is None:
        return []
    if s.min_replicas > s.replicas:
        return [Problem("spec.minReplicas", f"{s.min_replicas} is more than replicas ({s.replicas}); use at most "
                                            f"{s.replicas}, or remove it for a fixed-size gang")]
    if not s.elastic:
        return []
    out = []
    if s.scheduling.gang != "native":
        out.append(Problem("spec.minReplicas", f"an elastic gang is sized by seqtrain's own placement "
                           f"(scheduling.gang: native); {s.scheduling.gang} admits a gang of a fixed size: use gang "
                           "native or remove minReplicas"))
    if bad := size_problems(job.with_replicas(s.min_replicas), m):
        fits = [n for n in range(s.replicas - 1, 0, -1) if not size_problems(job.with_replicas(n), m)]
        hint = f"sizes below {s.replicas} that work: {', '.join(map(str, fits))}" if fits else \
            f"no size below {s.replicas} works with this layout and batch"
        out.append(Problem("spec.minReplicas", f"{s.min_replicas} replicas cannot run this job ({bad[0].path}: "
                                               f"{bad[0].message}); {hint}"))
    return out
