"""DeepSpeed ZeRO 0-3 (+ CPU offload) built from the job spec: nothing is configured twice.

Carried over from the spec: the optimizer (the same AdamW parameter groups as the native engine: weight-decay
exclusions, embedding learning-rate scale; DeepSpeedCPUAdam with the same hyper-parameters when states are
offloaded), the learning-rate schedule (our LambdaLR, stepped by DeepSpeed at each boundary), gradient
clipping, gradient accumulation (the loop's micro-batches per step), precision (bf16 / fp16 with dynamic loss
scaling) and the bucket size. DeepSpeed averages gradients over data-parallel ranks and divides by the
accumulation count; the loss passed to `backward` is pre-multiplied by both, so the update is the
global-batch gradient of the token-normalised loss, as in every other engine.

Checkpoints: the layout-independent tree of `seqtrain.checkpoint.dcp_format`, built with DeepSpeed's
tensor-fragment API (`safe_get_full_fp32_param` / `safe_get_full_optimizer_state`: the fp32 master weights and Adam
moments of each parameter, gathered from the ZeRO partitions), so a native, FSDP2 or DeepSpeed job at any
data-parallel size resumes it, and this engine resumes theirs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from seqtrain.data import Batch
from seqtrain.engine.base import Engine, StepStats
from seqtrain.models import build_model
from seqtrain.optim.build import build_scheduler, param_groups
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob


def ds_config(job: SeqTrainJob, ctx: DistContext, accum: int) -> dict[str, Any]:
    s = job.spec
    opt = s.optimization
    tr = s.training
    zero: dict[str, Any] = {
        "stage": opt.zero.stage,
        "reduce_bucket_size": opt.bucket_mb * 2**20 // 4,  # elements (fp32)
        "allgather_bucket_size": opt.bucket_mb * 2**20 // 4,
        "overlap_comm": ctx.device.type == "cuda",  # overlap reduction with backward where streams exist
        "contiguous_gradients": True,
    }
    if opt.zero.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": ctx.device.type == "cuda"}
        if opt.zero.stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": ctx.device.type == "cuda"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": tr.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "train_batch_size": tr.micro_batch_size * accum * ctx.dp_size,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # our own optimizer object is the spec's AdamW; DeepSpeed must not swap it
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if tr.grad_clip is not None:
        cfg["gradient_clipping"] = tr.grad_clip
    if opt.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif opt.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000}
    return cfg


def init_distributed(ctx: DistContext) -> None:
    import deepspeed

    backend = ctx.backend
    if not ctx.distributed and not dist.is_initialized():
        # One rank is a legitimate layout (a laptop, a single-GPU box), but DeepSpeed's collectives need a
        # process group even then: a private one-member group over an in-memory store (no port, no peers).
        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def build_partitioned(job: SeqTrainJob, ctx: DistContext) -> nn.Module:
    """The job's model as ZeRO-3 partitions from the start (`deepspeed.zero.Init`: each module is partitioned as
    soon as it is constructed, so a rank holds one module at a time, never the model), then every partition is
    filled with the single process's initial values (`GPT.init_weights` draws one full tensor at a time on the
    host and keeps this rank's slice: `seqtrain.runtime.shards`)."""
    import deepspeed

    init_distributed(ctx)
    cfg = ds_config(job, ctx, job.spec.grad_accum)
    # mem_efficient_linear=False: DeepSpeed would otherwise replace torch.nn.functional.linear for the whole process
    with deepspeed.zero.Init(config_dict_or_path=cfg, mem_efficient_linear=False):
        model = build_model(job.spec.model)  # GPT leaves ZeRO-3 partitions uninitialised (no patched constructors)
    model.init_weights(buffer_device=ctx.device)  # type: ignore[operator]
    return model


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        super().__init__(model, job, ctx)
        import deepspeed

        init_distributed(ctx)
        ospec = job.spec.training.optimizer
        if job.spec.optimization.zero.offload == "cpu" and ctx.device.type == "cuda":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            # Offloaded states are updated on the host by DeepSpeed's vectorised CPU Adam (a C++ extension,
            # compiled on first use into TORCH_EXTENSIONS_DIR). On CPU-only runs the model already lives in host
            # memory, so the spec's torch AdamW updates the offloaded partition instead (no extra compile).
            self.optimizer = DeepSpeedCPUAdam(param_groups(model, ospec), lr=ospec.lr, betas=tuple(ospec.betas),
                                              eps=ospec.eps, weight_decay=ospec.weight_decay, adamw_mode=True)
            self.scheduler = build_scheduler(self.optimizer, job.spec.training.schedule, job.spec.training.steps)
        self.accum = job.spec.grad_accum
        self.ds, _, _, _ = deepspeed.initialize(model=self.loss_module, optimizer=self.optimizer,
                                                lr_scheduler=self.scheduler, config=ds_config(job, ctx, self.accum),
                                                dist_init_required=False)

    def step(self, micro_batches: list[Batch]) -> StepStats:
        dev = self.ctx.device
        batches = [b.to(dev) for b in micro_batches]
        if len(batches) != self.ds.gradient_accumulation_steps():
            self.ds.set_train_batch_size(self.ds.train_micro_batch_size_per_gpu() * len(batches) * self.ctx.dp_size)
        tokens = torch.stack([b.num_targets() for b in batches]).sum().double()
        self.ctx.all_reduce(tokens, group=self.ctx.dp_group)
        # undo DeepSpeed's mean over dp ranks (x dp); scale_wrt_gas=False keeps it from dividing by the accum
        scale = float(self.ctx.dp_size) / max(1.0, float(tokens))  # host sync: a float for backward
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        for b in batches:
            ls = self.ds(b.tokens, b.targets, b.doc_ids)
            self.ds.backward(ls * scale, scale_wrt_gas=False)
            self.ds.step()  # updates only at the accumulation boundary (the last micro-batch)
            loss_sum += ls.detach().double()
        norm = self.ds.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        skipped = bool(getattr(self.ds, "skipped_steps", 0) > getattr(self, "_skipped_before", 0))
        self._skipped_before = getattr(self.ds, "skipped_steps", 0)
        totals = torch.stack([loss_sum, torch.tensor(float(sum(b.slots for b in batches)), dtype=torch.float64,
                                                     device=dev)])
        self.ctx.all_reduce(totals, group=self.ctx.dp_group)
        scale_now = None
        if self.job.spec.optimization.precision == "fp16":
            scale_now = float(getattr(self.ds.optimizer, "cur_scale", getattr(self.ds.optimizer, "loss_scale", 0)))
        return StepStats(loss_sum=float(totals[0]), target_tokens=int(tokens), slots=int(totals[1]),
                         grad_norm=grad_norm,
                         skipped=skipped, loss_scale=scale_now)

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> tuple[float, int]:
        self.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        count = 0
        for b in batches:
            b = b.to(self.ctx.device)
            total += self.ds(b.tokens, b.targets, b.doc_ids).double()
            count += int(b.num_targets())
        return float(total), count

    # ---- checkpoints: the common DCP tree ------------------------------------------------------------------
    def _trainable(self) -> list[tuple[str, nn.Parameter, int]]:
        """(single-process name, parameter, optimizer group index) of every trained parameter."""
        group_of = {id(p): i for i, g in enumerate(param_groups(self.model, self.job.spec.training.optimizer))
                    for p in g["params"]}
        return [(n, p, group_of[id(p)]) for n, p in self.model.named_parameters() if id(p) in group_of]

    def _frozen(self) -> list[tuple[str, torch.Tensor]]:
        """Weights that are not trained (LoRA's base) and persistent buffers: saved, never in the optimizer."""
        trained = {n for n, _, _ in self._trainable()}
        keys = set(self.model.state_dict().keys())
        named = [*self.model.named_parameters(), *self.model.named_buffers()]
        return [(n, t) for n, t in named if n in keys and n not in trained]

    def _base_states(self) -> list[dict[str, Any]]:
        """The wrapped torch optimizer's per-partition states (where the Adam step count lives)."""
        inner = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)
        return [st for st in inner.state.values() if "step" in st]

    @torch.no_grad()
    def _link_states(self) -> None:
        """ZeRO 1/2 create Adam's states at the first step and link them to the parameters' fragments after the
        first group's step (later groups stay unlinked: their state did not exist yet). Create them if missing (a
        zero-gradient step at lr 0 changes no weight; its step count is overwritten by a load) and link them all,
        so `safe_get/set_full_optimizer_state` see every parameter's."""
        zero = self.ds.optimizer
        flats = getattr(zero, "single_partition_of_fp32_groups", None)
        if flats is None or not hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
            return  # ZeRO-3 creates and reads its states itself
        inner = zero.optimizer
        if any(not inner.state.get(f) for f in flats):
            saved = [(g["lr"], f.grad) for g, f in zip(inner.param_groups, flats, strict=True)]
            for g, f in zip(inner.param_groups, flats, strict=True):
                g["lr"], f.grad = 0.0, torch.zeros_like(f)
            inner.step()
            for g, f, (lr, grad) in zip(inner.param_groups, flats, saved, strict=True):
                g["lr"], f.grad = lr, grad
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        """A frozen weight or buffer as one full tensor (ZeRO-3 keeps even frozen weights partitioned)."""
        if hasattr(t, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([t]):
                return t.detach().clone().cpu()
        return t.detach().cpu()

    def checkpoint_state(self) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        model: dict[str, torch.Tensor] = {}
        optim: dict[str, Any] = {}
        self._link_states()
        steps = self._base_states()
        step = steps[0]["step"] if steps else torch.tensor(0.0)
        hyper = self.optimizer.param_groups
        for name, p, gi in self._trainable():  # collective on every rank, in the same order
            model[name] = safe_get_full_fp32_param(p).detach().cpu()
            for key in ("exp_avg", "exp_avg_sq"):
                value = safe_get_full_optimizer_state(p, key)
                if value is not None:
                    optim[f"state.{name}.{key}"] = value.detach().cpu()
            optim[f"state.{name}.step"] = torch.as_tensor(step, dtype=torch.float32).detach().clone().cpu()
            for key, value in hyper[gi].items():
                if key != "params":
                    optim[f"param_groups.{name}.{key}"] = value
        for name, t in self._frozen():
            model[name] = self._full(t)
        state: dict[str, Any] = {"model": model, "optim": optim, "scheduler": self.scheduler.state_dict()}
        if self.job.spec.optimization.precision == "fp16":
            state["ds_loss_scale"] = float(getattr(self.ds.optimizer, "cur_scale", 0.0))
        return state

    def load_state(self, folder: str) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from seqtrain.checkpoint import dcp_format

        target = self.checkpoint_state()  # full tensors of this job's shapes, filled in place from the folder
        dcp_format.read(folder, target, self._dcp_group())
        model, optim = target["model"], target["optim"]
        for name, p, _ in self._trainable():
            full = model[name]
            safe_set_full_fp32_param(p, full)  # the fp32 master partition
            for key in ("exp_avg", "exp_avg_sq"):
                if f"state.{name}.{key}" in optim:
                    safe_set_full_optimizer_state(p, optim[f"state.{name}.{key}"], key)
            self._set_weight(p, full, deepspeed)  # the compute copy the next forward reads
        for name, t in self._frozen():
            self._set_weight(t, model[name], deepspeed)
        step = next((v for k, v in optim.items() if k.startswith("state.") and k.endswith(".step")), None)
        if step is not None:
            for st in self._base_states():
                # a tensor of its own per partition: AdamW increments it in place
                st["step"] = torch.tensor(float(step), dtype=st["step"].dtype, device=st["step"].device) \
                    if isinstance(st["step"], torch.Tensor) else float(step)
        self.scheduler.load_state_dict(target["scheduler"])
        self._reapply_schedule()
        if "ds_loss_scale" in target and target["ds_loss_scale"] and hasattr(self.ds.optimizer, "cur_scale"):
            self.ds.optimizer.cur_scale = target["ds_loss_scale"]

    @staticmethod
    @torch.no_grad()
    def _set_weight(t: torch.Tensor, full: torch.Tensor, deepspeed: Any) -> None:
        if hasattr(t, "ds_id"):  # ZeRO-3: gather, overwrite, re-partition (every rank holds the same value)
            with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                t.data.copy_(full.to(t.device))
        else:
            t.data.copy_(full.to(t.device))
