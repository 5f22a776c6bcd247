"""Which engine combines with which layout, and the parallel traps: checked at validation, torch-free.

Every problem names the field to change and a value that would work. The same table is in docs/user-guide.md
("Distributed training"); `tests/unit/test_layout.py` walks it.

| engine (how chosen)                   | dp | tp (gpt) | pp | dp x tp | dp x pp | tp x pp |
|---------------------------------------|----|----------|----|---------|---------|---------|
| DDP (native, zero.stage 0)            | ok | ok       | ok | ok      | ok      | ok      |
| FSDP2 (native, zero.stage 3)          | ok | ok       | no | ok      | no      | no      |
| DeepSpeed ZeRO 0-3 (+ offload at 1-3) | ok | no       | no | no      | no      | no      |

sequenceParallel goes wherever tp > 1 goes (DDP, FSDP2, pipelines); it needs tp > 1 and seqLen divisible by tp.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from seqtrain.layout.topology import INTERLEAVED_CHUNKS

if TYPE_CHECKING:  # annotations only: layout sits below the spec and never imports it
    from seqtrain.spec.job import SeqTrainJob
    from seqtrain.spec.model import ModelSpec


class Rule(NamedTuple):
    """A broken layout rule: the spec field to change and a message that names a value that works."""

    path: str
    message: str


def engine_of(job: SeqTrainJob) -> str:
    """ddp, fsdp2 or deepspeed: what implements the data-parallel part."""
    opt = job.spec.optimization
    if opt.engine == "deepspeed" or (opt.engine == "auto" and opt.zero.stage > 0):
        return "deepspeed"
    return "fsdp2" if opt.zero.stage == 3 else "ddp"


def _multiples(n: int, k: int) -> str:
    lo = n // k * k
    return f"{lo} or {lo + k}" if lo else f"{k}"


def parallel_problems(job: SeqTrainJob, m: ModelSpec) -> list[Rule]:
    """`m` is the resolved model spec (preset dims filled)."""
    s = job.spec
    opt = s.optimization
    tp, pp = opt.tensor_parallel, opt.pipeline_parallel
    out: list[Rule] = []
    engine = engine_of(job)

    if opt.engine == "native" and opt.zero.stage in (1, 2):
        out.append(Rule("spec.optimization.zero.stage",
                           f"the native engine has no ZeRO-{opt.zero.stage}; use 0 (DDP) or 3 (FSDP2), "
                           "or optimization.engine: deepspeed"))
    if opt.zero.offload != "none" and (engine != "deepspeed" or opt.zero.stage == 0):
        out.append(Rule("spec.optimization.zero.offload",
                           "CPU offload needs the DeepSpeed engine with zero.stage 1, 2 or 3 "
                           "(set optimization.engine: deepspeed and zero.stage >= 1), or use none"))
    if engine == "deepspeed" and (tp > 1 or pp > 1):
        field = "tensorParallel" if tp > 1 else "pipelineParallel"
        out.append(Rule(f"spec.optimization.{field}",
                           "the DeepSpeed engine runs data parallel only here; for tensor/pipeline parallel use "
                           "optimization.engine: native (zero.stage 0 = DDP; FSDP2 with zero.stage 3 combines "
                           "with tensorParallel), or set tensorParallel and pipelineParallel to 1"))
    if engine == "deepspeed" and opt.precision == "fp16" and s.resources.gpus == 0:
        out.append(Rule("spec.optimization.precision",
                           "DeepSpeed has no fp16 on CPU; use bf16 or fp32 there, or optimization.engine: native"))
    if engine == "fsdp2" and pp > 1:
        out.append(Rule("spec.optimization.pipelineParallel",
                           "FSDP2 (native, zero.stage 3) does not combine with pipeline parallel here; use "
                           "zero.stage 0 (DDP) with pipelineParallel, or pipelineParallel: 1"))
    if opt.grad_compression != "none" and engine != "ddp":
        out.append(Rule("spec.optimization.gradCompression",
                           f"gradient compression is a DDP communication hook and the {engine} engine has none; "
                           "use none, or optimization.engine: native with zero.stage 0"))
    if opt.grad_compression == "bf16" and s.resources.gpus == 0:
        out.append(Rule("spec.optimization.gradCompression",
                           "the bf16 all-reduce hook needs NCCL (GPUs); on CPU (gloo) use fp16 or none"))
    if opt.sequence_parallel and tp == 1:
        out.append(Rule("spec.optimization.sequenceParallel",
                           "sequence parallel shards along the tensor-parallel group; use tensorParallel > 1, or false"))
    if opt.sequence_parallel and tp > 1 and s.data.seq_len % tp:
        out.append(Rule("spec.data.seqLen",
                           f"sequence parallel splits each sequence over tensorParallel {tp}; use a multiple of "
                           f"{tp} (e.g. {_multiples(s.data.seq_len, tp)})"))

    if tp > 1 and m.dropout > 0 and not opt.sequence_parallel:
        # The residual stream is replicated over the tp group, but each rank draws its own dropout mask there, so
        # the copies would drift apart. Sequence parallel shards that stream, where per-rank masks are correct.
        out.append(Rule("spec.model.dropout",
                           f"dropout {m.dropout} with tensorParallel {tp} needs sequenceParallel: true (replicated "
                           "activations would get different masks on each rank); or use dropout 0"))
    if tp > 1:
        if m.arch != "gpt":
            out.append(Rule("spec.optimization.tensorParallel",
                               f"tensor parallel splits attention heads and MLPs (arch gpt); {m.arch} layers are not "
                               "split: use 1 and scale with pipelineParallel or data parallel"))
        else:
            if m.heads and m.heads % tp:
                out.append(Rule("spec.model.heads", f"{m.heads} heads cannot be split over tensorParallel {tp}; "
                                                       f"use a multiple of {tp} (e.g. {_multiples(m.heads, tp)})"))
            if m.kv_heads and m.kv_heads % tp:
                out.append(Rule("spec.model.kvHeads",
                                   f"{m.kv_heads} key/value heads cannot be split over tensorParallel {tp}; "
                                   f"use a multiple of {tp}"))
            if m.ffn_dim and m.ffn_dim % tp:
                out.append(Rule("spec.model.ffnDim", f"{m.ffn_dim} cannot be split over tensorParallel {tp}; "
                                                        f"use a multiple of {tp} (e.g. {_multiples(m.ffn_dim, tp)})"))
        if m.vocab_size and m.vocab_size % tp:
            out.append(Rule("spec.model.vocabSize",
                               f"the vocabulary-parallel embedding needs vocabSize divisible by tensorParallel {tp}; "
                               f"use {-(-m.vocab_size // tp) * tp} (ids above the tokenizer's are never used)"))

    if pp > 1:
        if m.arch == "qrnn":
            out.append(Rule("spec.optimization.pipelineParallel",
                               "pipeline stages split gpt, lstm and gru models; for qrnn use 1"))
        if s.data.packing:
            out.append(Rule("spec.data.packing", "packed documents are not supported with pipelineParallel > 1; "
                                                    "use false"))
        if opt.precision == "fp16":
            out.append(Rule("spec.optimization.precision",
                               "fp16 loss scaling is not wired into the pipeline schedules; use bf16 or fp32"))
        ev = s.training.eval
        step_rows = max(1, s.training.global_batch_size // s.dp)
        if ev.batches and (ev.batches * s.training.micro_batch_size) % step_rows:
            k = step_rows // math.gcd(step_rows, s.training.micro_batch_size)
            out.append(Rule("spec.training.eval.batches",
                               f"with pipeline parallel, evaluation runs in groups of globalBatchSize / dp = "
                               f"{step_rows} sequences; use a multiple of {k} batches"))
        if m.arch != "gpt" and opt.activation_checkpointing.policy != "none":
            out.append(Rule("spec.optimization.activationCheckpointing.policy",
                               "time-chunk checkpointing of recurrent models does not combine with pipeline "
                               "parallel; use none"))
        chunks = pp * (INTERLEAVED_CHUNKS if opt.pipeline_schedule == "interleaved" else 1)
        if m.layers and m.layers < chunks:
            what = f"{pp} stages x {INTERLEAVED_CHUNKS} chunks" if chunks > pp else f"{pp} stages"
            out.append(Rule("spec.optimization.pipelineParallel",
                               f"{m.layers} layers cannot fill {what}; use at most {m.layers // (chunks // pp)} "
                               "stages or more model.layers"))
        per_dp = s.training.global_batch_size // s.dp
        micro = opt.micro_batches
        if micro is not None:
            if micro < pp:
                out.append(Rule("spec.optimization.microBatches",
                                   f"{micro} micro-batches cannot keep {pp} pipeline stages busy; use at least {pp} "
                                   f"(2 x stages = {2 * pp} keeps the bubble at {(pp - 1) / (3 * pp - 1):.0%})"))
            elif per_dp % micro:
                out.append(Rule("spec.optimization.microBatches",
                                   f"{micro} must divide the sequences per data-parallel rank and step "
                                   f"(globalBatchSize / dp = {per_dp})"))
            elif opt.pipeline_schedule == "interleaved" and micro % pp:
                out.append(Rule("spec.optimization.microBatches",
                                   f"the interleaved schedule needs a multiple of the {pp} stages"))
        elif per_dp < pp:
            out.append(Rule("spec.training.globalBatchSize",
                               f"{per_dp} sequences per data-parallel rank cannot feed {pp} pipeline stages one "
                               f"micro-batch each; use globalBatchSize of at least {pp * s.dp}"))
        elif not any(per_dp % k == 0 for k in range(pp, per_dp + 1)) or (
                opt.pipeline_schedule == "interleaved" and per_dp % pp):
            out.append(Rule("spec.optimization.microBatches",
                               f"no micro-batch count >= {pp} divides {per_dp} sequences per data-parallel rank; "
                               "set optimization.microBatches"))
    return out


def pipeline_micro_batches(job: SeqTrainJob) -> int:
    """Pipeline micro-batches per step: optimization.microBatches, by default the divisor of the sequences per
    data-parallel rank closest to 2 x stages (at least the stage count; a multiple of it when interleaved).
    Without pipeline parallel: the gradient-accumulation count."""
    s = job.spec
    opt = s.optimization
    pp = opt.pipeline_parallel
    if pp == 1:
        return s.grad_accum
    if opt.micro_batches is not None:
        return opt.micro_batches
    per_dp = max(1, s.training.global_batch_size // s.dp)
    fits = [k for k in range(pp, per_dp + 1)
            if per_dp % k == 0 and (opt.pipeline_schedule != "interleaved" or k % pp == 0)]
    return min(fits, key=lambda k: (abs(k - 2 * pp), k)) if fits else per_dp
