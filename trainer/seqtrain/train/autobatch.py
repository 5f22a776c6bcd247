"""`training.microBatchSize: auto` in the rank process: the estimate's choice (`seqtrain.spec.memory.auto_micro_batch`)
confirmed by one probe step per candidate before the trainer is built, stepping down while a step does not fit.

A probe step is a forward, backward and AdamW step of the job's model (built as `seqtrain bench memory` builds it,
activation checkpointing applied) on one micro-batch of random ids of data.seqLen, on the rank's device:
- on a GPU it fits when it raises no out-of-memory error and its peak (the caching allocator's) stays within the
  device's memory;
- everywhere the rank's peak resident set during the step (VmHWM after /proc/self/clear_refs; the training data
  loaded meanwhile, so the peak holds it too), and the estimate for that size, times the ranks of a replica must
  stay within resources.memory: what the pod's limit counts.
Every rank probes the same candidate and the ranks agree (all-reduce of "fits"), so all train with one size.

The probe builds the whole model, which is what a data-parallel rank holds (DDP, one process). With FSDP2 or ZeRO a
rank holds shards, so the probe would overstate the need: there the estimate's choice stands unprobed, and the
reason says so. The probe's model is freed before the trainer builds its own (the launcher's malloc settings
return it to the OS).
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from seqtrain.spec.cluster import quantity_value
from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.memory import AUTO_MARKER, auto_micro_batch, estimate, gib, with_micro_batch

MARKER = AUTO_MARKER  # the line rank 0 logs: the choice and its reason
PHASE = "choosing microBatchSize (auto: probe steps)"  # the start-up phase the probing is


def resident_bytes(field: str = "VmRSS") -> int | None:
    """This process's resident set (VmRSS) or its peak (VmHWM), bytes; None without /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Start VmHWM again from the current resident set (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class Probe:
    fits: bool
    peak_host: float  # bytes, this rank's peak resident set during the step (0 when not measured)
    peak_device: float  # bytes, the CUDA allocator's peak (0 on CPU)
    oom: bool = False  # out of memory on the GPU
    over: bool = False  # stopped at the rank's share of resources.memory


class OverBudget(Exception):
    """The probe step's resident set passed the rank's share of resources.memory: this size does not fit."""


def _guard(model: object, budget: float | None) -> list:
    """Hooks that end the probe step (OverBudget) as soon as the resident set passes `budget`, at every module's
    forward and backward: a CPU rank over its pod's limit is killed, so the probe must stop before it gets there."""
    if budget is None:
        return []

    def check(*_: object) -> None:
        now = resident_bytes()
        if now is not None and now > budget:
            raise OverBudget(f"resident {gib(now)} > {gib(budget)}")

    handles = []
    for mod in model.modules():  # type: ignore[attr-defined]
        handles.append(mod.register_forward_hook(check))
        handles.append(mod.register_full_backward_hook(check))
    return handles


def probe_step(job: SeqTrainJob, size: int, device: object, budget: float | None = None) -> Probe:
    """One forward + backward + AdamW step of `job`'s model on `size` sequences, on `device`; `budget`: bytes of
    resident set at which the step gives up (does not fit)."""
    import torch

    from seqtrain.models import build_model
    from seqtrain.models.activation_checkpointing import apply_activation_checkpointing
    from seqtrain.models.loss import linear_cross_entropy

    spec = job.spec
    dev = torch.device(device)  # type: ignore[arg-type]
    measured = reset_peak()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    model = opt = None
    handles: list = []
    oom = over = False
    try:
        model = build_model(spec.model).to(dev)
        apply_activation_checkpointing(model, spec.optimization.activation_checkpointing, spec.data.seq_len)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-9)
        handles = _guard(model, budget)
        tokens = torch.randint(0, spec.model.vocab_size or 256, (size, spec.data.seq_len), device=dev)
        loss = linear_cross_entropy(model(tokens), model.output_weight, torch.roll(tokens, -1, dims=1))
        with warnings.catch_warnings():  # the embedding's hook fires on its outputs only: that is all it checks
            warnings.filterwarnings("ignore", message="Full backward hook", category=UserWarning)
            loss.backward()
        opt.step()
        _guard_now(budget)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except torch.OutOfMemoryError:
        oom = True
    except Exception as exc:  # noqa: BLE001 - OverBudget, also when autograd re-raises it from a backward hook
        if "OverBudget" not in repr(exc) and not isinstance(exc, OverBudget):
            raise
        over = True
    finally:
        for h in handles:
            h.remove()
        del model, opt, handles
        gc.collect()
    peak_device = float(torch.cuda.max_memory_reserved(dev)) if dev.type == "cuda" else 0.0
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(dev).total_memory
        oom = oom or peak_device > total
    peak_host = float(resident_bytes("VmHWM") or 0) if measured else 0.0
    return Probe(fits=not (oom or over), peak_host=peak_host, peak_device=peak_device, oom=oom, over=over)


def _guard_now(budget: float | None) -> None:
    now = resident_bytes()
    if budget is not None and now is not None and now > budget:
        raise OverBudget(f"resident {gib(now)} > {gib(budget)}")


def beside_the_step(job: SeqTrainJob, size: int) -> float:
    """Host bytes the trainer holds that a probe step does not: DDP's gradient buckets (a copy of the gradients,
    world > 1) and the async checkpoint's staging copy of the weights and optimizer states (on CPU)."""
    b = estimate(job, size).busiest
    extra = b.grads if job.spec.world_size > 1 else 0.0
    if job.spec.checkpoint.async_save and job.spec.resources.gpus == 0:
        extra += b.params + b.optimizer
    return extra


def choose(job: SeqTrainJob, device: object, agree: Callable[[bool, float], tuple[bool, float]],
           probe: Callable[..., Probe] = probe_step) -> tuple[SeqTrainJob, str]:
    """The job with microBatchSize auto replaced by the size that fits, and the reason (one line). `agree(fits,
    peak)`: every rank's verdict and peak combined (all fit, highest peak).

    From the estimate's choice down: one probe step per candidate until one fits. A CPU rank over its pod's limit
    would be killed, so a probe step stops (does not fit) as soon as the rank's resident set passes its share of
    resources.memory less what the trainer holds beside the step (`beside_the_step`)."""
    from seqtrain.layout.rules import engine_of

    first = auto_micro_batch(job)
    engine = engine_of(job)
    if engine != "ddp":
        return with_micro_batch(job, first.size), f"{first.reason}; not probed: engine {engine} shards the model"
    r = job.spec.resources
    limit = float(quantity_value(r.memory))
    cands = first.candidates
    tried: list[str] = []
    for size in cands[cands.index(first.size):]:
        budget = limit / r.procs - beside_the_step(job, size)
        result = probe(job, size, device, budget)
        fits, peak = agree(result.fits, result.peak_host)
        need = (peak + beside_the_step(job, size)) * r.procs
        fact = f"probe step: {gib(need)} per replica of resources.memory {r.memory}"
        if fits and not tried:
            return with_micro_batch(job, size), f"{first.reason}; {fact}"
        if fits:
            return with_micro_batch(job, size), (f"microBatchSize auto -> {size}, gradient accumulation "
                                                 f"{cands[0] // size} ({tried[-1]}; {fact})")
        tried.append(f"{size} does not fit: " + ("out of memory on the GPU" if result.oom else
                                                 f"its probe step passed {gib(budget * r.procs)} per replica of "
                                                 f"resources.memory {r.memory}"))
    size = cands[-1]
    return with_micro_batch(job, size), f"microBatchSize auto -> {size} ({'; '.join(tried)}; the smallest)"


def distributed_agree(fits: bool, peak: float) -> tuple[bool, float]:
    """All ranks fit, and the highest peak (an all-reduce when there is a process group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fits, peak
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([0.0 if fits else 1.0, peak], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item() == 0.0, float(t[1].item())


def resolve_auto(job: SeqTrainJob, device: object, is_main: bool) -> tuple[SeqTrainJob, str | None]:
    """`microBatchSize: auto` -> a number, chosen and probed here, and why (rank 0 says it in its log, and the
    progress document carries it to either backend's status). Any other job as is, with no reason."""
    if job.spec.training.micro_batch_size != "auto":
        return job, None
    from seqtrain.data import build_train_data

    rank, world = int(os.environ.get("RANK", "0")), job.spec.world_size
    if is_main:
        from seqtrain.runtime.exitcodes import announce_phase

        announce_phase(PHASE)
    # The training data stays loaded while the candidates are probed: the peak then holds what the trainer will
    # hold beside the model (the corpus, its index), not only the step. Freed before the trainer loads its own.
    data = build_train_data(with_micro_batch(job, auto_micro_batch(job).size), rank, world)
    try:
        chosen, reason = choose(job, device, distributed_agree)
    finally:
        del data
        gc.collect()
    if is_main:  # said once: the local view prints this line (a phase would repeat it in the next one's "took")
        print(f"{MARKER}{reason}", flush=True)
    return chosen, reason


__all__ = ["MARKER", "PHASE", "Probe", "choose", "probe_step", "resident_bytes", "resolve_auto"]
