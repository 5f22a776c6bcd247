"""Memory per rank: the one estimate behind `seqtrain validate`, `plan` and `run`, the operator's planner and
`training.microBatchSize: auto` (torch-free, so the spec, the operator and the trainer share it).

Model states, activations and offloaded states follow the ZeRO paper's accounting (Rajbhandari et al., 2020, section 3.1 and 5).

Model states for Psi parameters on a rank, data-parallel degree N_d:

    mixed precision (bf16/fp16) Adam: 2 Psi fp16 params + 2 Psi fp16 grads + K Psi optimizer, K = 12
        (fp32 master weights 4 + momentum 4 + variance 4)
    fp32 Adam:                        4 Psi params      + 4 Psi grads      + 8 Psi (momentum + variance)

    ZeRO-0: everything replicated          ZeRO-1: optimizer / N_d
    ZeRO-2: optimizer and grads / N_d      ZeRO-3: params, grads and optimizer / N_d
    offload cpu: optimizer states live in host memory (ZeRO-3 offload: the parameter shard too).

DeepSpeed follows this split; the native engines (DDP, FSDP2) keep fp32 weights and gradients under autocast,
so with bf16/fp16 they are counted 4 + 4 + 8 (the same 16 bytes per parameter).

FSDP2 also holds an unsharded working set on top of its shards (`fsdp_working_set`): the root unit
(embedding, final norm, output projection: kept gathered from forward to backward), two blocks gathered at
once (the one computing and the one prefetched), in the gather dtype (bf16 under bf16 precision, else fp32),
and one block's unsharded fp32 gradient before its reduce-scatter. Gradients are reduce-scattered every
micro-batch, so no full unsharded gradient is kept across accumulation steps.

Psi is what the rank holds after tensor and pipeline parallel took their share: matrices of a block are split
by tp (norms replicated), the vocabulary by tp, blocks by pipeline stage. Activations follow Korthikanti et al.
(2022) adapted to this model (SwiGLU MLP, RMSNorm, flash-style attention that stores no seq x seq scores):
values below are elements per token per block, times bytes of the compute precision:

    GPT block:  attention 2h (norm in/out) + q + 2 kv (q, k, v: heads / kv heads x head dim) + q (attention out)
                MLP       2h (norm in/out) + 4 f (SwiGLU: gate, up, activation, product; GELU: 2 f, up, activation)
                tensor parallel divides the q/k/v/out and f terms by tp, sequence parallel the norm terms too
                (and the residual-stream inputs checkpointing keeps): every block term / tp, as measured by
                `python -m seqtrain.benchmarks.seqpar`.
    LSTM layer: 7h (input, 4 gates, cell, hidden); GRU/QRNN 5h.
    head:       fp32 logits and their gradient, 2 x 4 bytes x vocab / tp per token (0 with fused kernels).

Activation checkpointing keeps one h per checkpointed block plus one block's full activations for recompute.
Pipeline stages hold several micro-batches in flight: GPipe all m, 1F1B min(m, pp - stage), interleaved
about (2 (pp - 1) + (v - 1) pp + 1) / v. Estimates, not measurements: allocator fragmentation, framework
buffers (DeepSpeed buckets, NCCL) and the CUDA context (~0.5 GiB) come on top.

Host memory per rank adds the process baseline, BASELINE_BYTES: what a rank process holds beside its model (the
interpreter, torch and the trainer's imports, the gloo process group, the first step's code and caches, glibc's heap
under the launcher's malloc settings). A replica (a pod) needs procs x (baseline + the states it keeps in host memory); `resources.memory`
is checked against that (`memory_problems`) and the local backend enforces it (seqtrain_operator.local.runner).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from seqtrain.layout.costs import ParamBreakdown, param_breakdown, stage_bounds
from seqtrain.layout.rules import engine_of, pipeline_micro_batches
from seqtrain.layout.topology import INTERLEAVED_CHUNKS
from seqtrain.spec.cluster import quantity_value
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.lora import lora_param_count
from seqtrain.spec.model import ModelSpec
from seqtrain.spec.optimization import planned_precision
from seqtrain.spec.problems import Problem
from seqtrain.spec.resolve import resolved_model

# What a rank process holds beside its model's states and activations: the busiest rank's peak resident set through
# a real 2-rank gloo job of the tiny GPT that does what a run does besides its steps (the built-in corpus in memory,
# an evaluation pass, two checkpoint saves; ranks started as the launcher starts them, its malloc settings), less
# that model's estimate (2.5 MiB). Torch 2.13 CPU wheel, Python 3.11, Linux x86_64, 2 cores, 2026-11-28, 3 runs:
#     seqtrain bench memory --baseline
#     -> {"before_model_bytes": [713105408, 707735552], "peak_bytes": 811283251, "baseline_mib": 771.2, ...}
#     (771.0 and 771.3 in the other two runs)
# Of it: ~680 MiB resident when the rank is about to build its model (`import torch` alone ~513 MiB, the trainer's
# imports, gloo, the built-in corpus), the rest the first model build, steps, evaluation and saves. Measured over
# two steps of synthetic data the baseline was 706 MiB, and a 770Mi quickstart replica passed the verdict and was
# then OOM-killed at every restart (its ranks peaked at 830-853 MiB against an estimate of 758.6 MiB; now 823.6).
# Not counted: on a GPU, the CUDA context's host memory.
BASELINE_BYTES = 771 * 2**20
BASELINE_MARKER = "seqtrain train: process baseline "  # each rank's log line (train/entry.py) the benchmark reads

# bytes per parameter: (params, grads, optimizer states)
STATE_BYTES = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}


def state_bytes(precision: str) -> tuple[int, int, int]:
    return STATE_BYTES["fp32" if precision == "fp32" else "mixed"]


@dataclass(frozen=True)
class ModelStates:
    params: float
    grads: float
    optimizer: float
    cpu: float  # bytes moved to host memory by offload

    @property
    def device(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(psi: int, precision: str, zero_stage: int, dp: int, offload: str = "none") -> ModelStates:
    """ZeRO-paper model-state bytes of one rank holding `psi` parameters (before ZeRO partitioning)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0..3, got {zero_stage}")
    bp, bg, bo = state_bytes(precision)
    params = bp * psi / (dp if zero_stage >= 3 else 1)
    grads = bg * psi / (dp if zero_stage >= 2 else 1)
    opt = bo * psi / (dp if zero_stage >= 1 else 1)
    cpu = 0.0
    if offload == "cpu" and zero_stage >= 1:
        cpu, opt = opt, 0.0
        if zero_stage == 3:
            cpu, params = cpu + params, 0.0
    return ModelStates(params=params, grads=grads, optimizer=opt, cpu=cpu)


def stage_params(p: ParamBreakdown, bounds: list[tuple[int, int]], stage: int, tp: int, tied: bool) -> int:
    """Parameters one rank of pipeline stage `stage` holds, after tensor parallel."""
    start, end = bounds[stage]
    per_block = p.block_tp_split // tp + (p.block - p.block_tp_split)
    n = per_block * (end - start)
    last = stage == len(bounds) - 1
    if stage == 0:
        n += p.embedding // tp
    if last:
        n += p.final + p.output // tp
        if tied and len(bounds) > 1:
            n += p.embedding // tp  # the last stage keeps its own copy of the tied embedding (Megatron-style)
    return n


def fsdp_working_set(p: ParamBreakdown, tp: int, precision: str, has_root: bool) -> tuple[float, float]:
    """(gathered parameter bytes, unsharded gradient bytes) FSDP2 holds beyond its shards on one rank."""
    gather = 2 if precision == "bf16" else 4  # MixedPrecisionPolicy(param_dtype=bf16) under bf16
    block = p.block_tp_split // tp + (p.block - p.block_tp_split)
    root = (p.embedding + p.final + p.output) // tp if has_root else 0
    return gather * (root + 2 * block), 4.0 * block


def block_activation_elems(m: ModelSpec, tp: int, sequence_parallel: bool) -> float:
    """Elements stored per token for one block's backward, without checkpointing."""
    h = m.dim or 0
    if m.arch == "gpt":
        hd = m.head_dim or h // (m.heads or 1)
        q, kv = hd * (m.heads or 1), hd * (m.kv_heads or 1)
        f = m.ffn_dim or 0
        norms = 4 * h / (tp if sequence_parallel else 1)
        mlp = 4 * f if m.mlp == "swiglu" else 2 * f  # gate, up, activation, product | up, activation
        return norms + (q + 2 * kv + q + mlp) / tp
    return (7 if m.arch == "lstm" else 5) * h


def in_flight(schedule: str, pp: int, m: int, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        v = INTERLEAVED_CHUNKS
        return min(float(m), (2 * (pp - 1 - stage) + (v - 1) * pp + 1) / v)
    return float(min(m, pp - stage))


def stored_blocks(policy: str, every: int, blocks: int) -> tuple[float, float]:
    """(blocks whose activations stay whole, checkpointed blocks that keep only their input)."""
    if blocks == 0 or policy == "none":
        return float(blocks), 0.0
    if policy == "full":
        return 1.0, float(blocks)  # one block is recomputed at a time
    if policy == "every":
        ck = math.ceil(blocks / every)
        return float(blocks - ck + 1), float(ck)
    if policy == "sqrt":
        seg = max(1, round(math.sqrt(blocks)))
        return float(math.ceil(blocks / seg)), float(seg)
    # selective: recompute attention/MLP internals, keep the sublayer inputs (about 2h of the block's total)
    return 1.0, float(blocks)


@dataclass(frozen=True)
class RankMemory:
    stage: int
    blocks: tuple[int, int]
    params_count: int
    params: float
    grads: float
    optimizer: float
    activations: float
    cpu: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def to_dict(self) -> dict:
        out = asdict(self)
        out["total"] = self.total
        return out


@dataclass(frozen=True)
class MemoryEstimate:
    engine: str  # what implements the data-parallel part: ddp, fsdp2, deepspeed
    zero_stage: int  # the ZeRO-equivalent stage used for the accounting
    precision: str
    micro_batch: int  # sequences per forward on one rank (pipeline micro-batch with pp > 1)
    pipeline_micro_batches: int
    total_params: int
    stages: tuple[RankMemory, ...]
    trainable_params: int | None = None  # with model.lora: the adapters (everything else is frozen)
    baseline: float = BASELINE_BYTES  # host memory of each rank process before its model

    @property
    def busiest(self) -> RankMemory:
        return max(self.stages, key=lambda r: r.total)

    def host_per_rank(self, gpus: int) -> float:
        """Host memory of the busiest rank: the process baseline, offloaded states, and on CPU everything."""
        return self.baseline + max(s.cpu + (s.total if gpus == 0 else 0) for s in self.stages)


def effective_engine(job: SeqTrainJob) -> tuple[str, int]:
    """(engine, ZeRO-equivalent stage used for the accounting): DDP is ZeRO-0, FSDP2 ZeRO-3."""
    engine = engine_of(job)
    return engine, {"ddp": 0, "fsdp2": 3}.get(engine, job.spec.optimization.zero.stage)


def estimate(job: SeqTrainJob, micro_batch: int | None = None) -> MemoryEstimate:
    """The estimate for `job`; `micro_batch` replaces training.microBatchSize (`auto`: the one `auto_micro_batch`
    chooses)."""
    if micro_batch is None and job.spec.training.micro_batch_size == "auto":
        micro_batch = auto_micro_batch(job).size
    if micro_batch is not None:
        job = with_micro_batch(job, micro_batch)
    s = job.spec
    opt = s.optimization
    m = resolved_model(job)
    p = param_breakdown(m)
    engine, zstage = effective_engine(job)
    tp, pp, dp = opt.tensor_parallel, opt.pipeline_parallel, s.dp
    seq = s.data.seq_len
    n_micro = pipeline_micro_batches(job)
    if pp > 1:
        mb = max(1, s.training.global_batch_size // dp // max(1, n_micro))
    else:
        mb = s.training.micro_batch_size
    precision = planned_precision(opt.precision, s.resources.gpus)  # `auto`: fp32 on CPU, bf16 with GPUs
    act_bytes = 4 if precision == "fp32" else 2
    bounds = stage_bounds(m, pp, seq)
    fused_loss = bool(opt.kernels)  # kernels are opt-in (seqtrain.models.dispatch): unset is the reference loss
    ac = opt.activation_checkpointing
    h = m.dim or 0
    stages = []
    for st in range(pp):
        psi = stage_params(p, bounds, st, tp, m.tie_embeddings)
        # The native engines (DDP, FSDP2) autocast with fp32 weights and gradients: same 16 bytes per
        # parameter as the paper's mixed-precision Adam, split 4 + 4 + 8 instead of 2 + 2 + 12; with
        # paramDtype bf16 the native engine holds the paper's split (bf16 weights and grads, fp32 masters).
        split = precision if engine == "deepspeed" or opt.param_dtype == "bf16" else "fp32"
        ms = model_state_bytes(psi, split, zstage, dp, opt.zero.offload)
        if m.lora is not None:  # frozen weights: no gradients or optimizer states for them, only for adapters
            ad = model_state_bytes(lora_param_count(m), "fp32", zstage, dp, opt.zero.offload)
            ms = ModelStates(params=ms.params + ad.params, grads=ad.grads, optimizer=ad.optimizer, cpu=ad.cpu)
        params, grads = ms.params, ms.grads
        if engine == "fsdp2" and dp > 1:
            extra_p, extra_g = fsdp_working_set(p, tp, precision, has_root=True)
            params, grads = params + extra_p, grads + extra_g
        nblocks = bounds[st][1] - bounds[st][0]
        whole, ckpt = stored_blocks(ac.policy, ac.every, nblocks)
        per_block = block_activation_elems(m, tp, opt.sequence_parallel)
        # Sequence parallel also shards what checkpointed blocks keep (their residual-stream inputs, and the
        # norm outputs with selective) and the stage's input: each rank holds T / tp positions of them.
        shard = tp if opt.sequence_parallel else 1
        if ac.policy == "selective" and m.arch == "gpt":
            per_tok = whole * per_block + ckpt * 2 * h / shard
        else:
            per_tok = whole * per_block + ckpt * h / shard
        per_tok *= act_bytes
        per_tok += h * act_bytes / shard  # the stage's input (embedding output or the previous stage's output)
        if st == pp - 1 and not fused_loss:
            per_tok += 2 * 4 * (m.vocab_size or 0) / tp
        acts = per_tok * mb * seq * in_flight(opt.pipeline_schedule, pp, n_micro, st)
        stages.append(RankMemory(stage=st, blocks=bounds[st], params_count=psi, params=params, grads=grads,
                                 optimizer=ms.optimizer, activations=acts, cpu=ms.cpu))
    return MemoryEstimate(engine=engine, zero_stage=zstage, precision=precision, micro_batch=mb,
                          pipeline_micro_batches=n_micro, total_params=p.total, stages=tuple(stages),
                          trainable_params=lora_param_count(m) if m.lora is not None else None)


def gib(x: float) -> str:
    if x == 0:
        return "-"
    if x >= 2**30:
        return f"{x / 2**30:.2f} GiB"
    if x >= 2**20:
        return f"{x / 2**20:.1f} MiB"
    return f"{x / 2**10:.1f} KiB"


# ---- the verdict: does the estimate fit what the job asks for? ----------------------------------------------------

# GPU memory from the product label (`NVIDIA-H100-80GB-HBM3`, `NVIDIA-A100-SXM4-40GB`): the only place a spec
# states it. Without a size in the name nothing is claimed.
_GB = re.compile(r"(\d+)GB", re.IGNORECASE)
LOWER = ("lower data.seqLen or training.microBatchSize (or set it to auto), set "
         "optimization.activationCheckpointing.policy, a higher optimization.zero.stage, or more replicas / "
         "tensorParallel / pipelineParallel")


def lower(job: SeqTrainJob) -> str:
    """LOWER, less the advice to set microBatchSize to auto where it is auto already (auto then chose the smallest
    micro-batch and it still does not fit)."""
    if job.spec.training.micro_batch_size == "auto":
        return LOWER.replace("training.microBatchSize (or set it to auto)", "training.globalBatchSize")
    return LOWER


def gpu_memory_bytes(product: str | None) -> int | None:
    m = _GB.search(product or "")
    return int(m.group(1)) * 10**9 if m else None


def replica_need(job: SeqTrainJob, est: MemoryEstimate) -> float:
    """Host memory one replica (a pod) needs by the estimate: its ranks' baselines and host-held states."""
    return est.host_per_rank(job.spec.resources.gpus) * job.spec.resources.procs


def memory_problems(job: SeqTrainJob, est: MemoryEstimate | None = None) -> list[Problem]:
    """THE memory verdict (`validate`, `plan` and `run` print it; exit 2): the estimate, process baseline included,
    against resources.memory per replica and the GPU's memory (from resources.gpuProduct)."""
    est = est or estimate(job)
    r = job.spec.resources
    out = []
    limit = float(quantity_value(r.memory))
    host = est.host_per_rank(r.gpus)
    if host * r.procs > limit:
        where = "memory" if r.gpus == 0 else "host memory"
        out.append(Problem("spec.resources.memory", f"the estimate needs {gib(host * r.procs)} of {where} per "
                           f"replica ({r.procs} rank(s) x (process baseline {gib(est.baseline)} + model "
                           f"{gib(host - est.baseline)}); see seqtrain plan), more than resources.memory {r.memory}: "
                           f"raise resources.memory to at least {quantity(host * r.procs)} (measured peaks run up "
                           f"to 4% over the estimate: {quantity(host * r.procs * 1.1)} leaves room), or "
                           f"{lower(job)}"))
    gpu = gpu_memory_bytes(r.gpu_product) if r.gpus > 0 else None
    device = max(s.total for s in est.stages)
    if gpu is not None and device > gpu:
        out.append(Problem("spec.resources.gpuProduct", f"the estimate needs {gib(device)} per GPU, more than the "
                           f"{gib(gpu)} of {r.gpu_product}: {lower(job)}, or optimization.zero.offload: cpu"))
    return out


def quantity(x: float) -> str:
    """A Kubernetes quantity at least `x` bytes, in whole MiB or GiB (what to write in resources.memory)."""
    mib = math.ceil(x / 2**20)
    return f"{math.ceil(mib / 1024)}Gi" if mib >= 4096 else f"{mib}Mi"


# ---- training.microBatchSize: auto ---------------------------------------------------------------------------

# The line rank 0 logs with auto's choice (seqtrain.train.autobatch); the local backend reads it into the status.
AUTO_MARKER = "seqtrain autobatch: "
AUTO_CHOICE = re.compile(r"microBatchSize auto -> (\d+)")


@dataclass(frozen=True)
class AutoBatch:
    """The micro-batch `auto` chooses by the estimate, why, and the candidates the trainer's probe may step down
    to (largest first; each divides the rows a data-parallel rank takes per step, so the global batch is kept)."""

    size: int
    reason: str
    candidates: tuple[int, ...]


def batch_candidates(job: SeqTrainJob) -> tuple[int, ...]:
    """Micro-batch sizes that keep training.globalBatchSize exactly: divisors of globalBatchSize / dp, largest
    first (gradient accumulation = that / the micro-batch)."""
    rows = max(1, job.spec.training.global_batch_size // job.spec.dp)
    return tuple(d for d in range(rows, 0, -1) if rows % d == 0)


def with_micro_batch(job: SeqTrainJob, size: int) -> SeqTrainJob:
    out = job.model_copy(deep=True)
    out.spec.training.micro_batch_size = size
    return out


def fits(job: SeqTrainJob, est: MemoryEstimate) -> tuple[bool, float, float]:
    """(fits, need, limit) of the tighter of host memory per replica and GPU memory (when the spec states it)."""
    r = job.spec.resources
    gpu = gpu_memory_bytes(r.gpu_product) if r.gpus > 0 else None
    if gpu is not None:
        need = max(s.total for s in est.stages)
        if need > gpu:
            return False, need, float(gpu)
    need, limit = replica_need(job, est), float(quantity_value(r.memory))
    return need <= limit, need, limit


def auto_micro_batch(job: SeqTrainJob) -> AutoBatch:
    """The largest candidate whose estimate fits resources.memory (and the GPU's memory when gpuProduct names
    it); the smallest when none fits (memory_problems then says so). The trainer confirms it with one probe step
    per candidate before training (seqtrain.train.autobatch)."""
    cands = batch_candidates(job)
    over: tuple[int, float, float] | None = None
    for size in cands:
        ok, need, limit = fits(job, estimate(job, size))
        if ok:
            why = (f"{over[0]} would need {gib(over[1])} of {gib(over[2])}" if over else
                   f"all {size} sequences a rank takes per step: {gib(need)} of {gib(limit)}")
            return AutoBatch(size, f"microBatchSize auto -> {size}, gradient accumulation {cands[0] // size} "
                                   f"({why}, by the estimate)", cands)
        over = (size, need, limit)
    size = cands[-1]
    return AutoBatch(size, f"microBatchSize auto -> {size}: even {size} needs {gib(over[1]) if over else '?'} of "
                           f"{gib(over[2]) if over else '?'}", cands)


def memory_notes(job: SeqTrainJob, est: MemoryEstimate | None = None) -> list[str]:
    """What `validate` and `plan` print beside a job that fits: the replica's need against resources.memory, and
    the micro-batch `auto` chose with its reason."""
    est = est or estimate(job)
    r = job.spec.resources
    out = [f"memory: a replica needs {gib(replica_need(job, est))} of resources.memory {r.memory} by the estimate "
           f"({r.procs} rank(s) x (process baseline {gib(est.baseline)} + {gib(est.host_per_rank(r.gpus) - est.baseline)}"
           f"{' in host memory' if r.gpus else ''})); the local backend enforces it as a pod's limit would"]
    if job.spec.training.micro_batch_size == "auto":
        out.append(auto_micro_batch(job).reason + "; the trainer confirms it with a probe step before training")
    return out
