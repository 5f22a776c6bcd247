"""Engine: owns the wrapped model, optimizer, scheduler and the optimizer step; the loop owns everything else.

`step(micro_batches)` runs forward/backward over this rank's micro-batches with the global-batch loss
normalisation (see `seqtrain.models.loss`), clips, steps the optimizer and the schedule, and returns global
`StepStats`. Checkpoints: every engine hands the checkpoint manager `checkpoint_state()`, the tree of
`seqtrain.checkpoint.dcp_format` (single-process names, full shapes: any engine and data-parallel size resumes it,
`load_state`; engines whose ranks hold parts of the model as plain tensors, or FSDP2 shards of such parts, set
`global_state`, which names and places those parts in the full model). `load(dir)` reads that tree; a step folder
without it is no checkpoint an engine can resume.
"""
from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqtrain.data import Batch
from seqtrain.engine.global_state import GlobalState
from seqtrain.models.loss import CausalLMLoss
from seqtrain.optim.build import build_optimizer, build_scheduler
from seqtrain.runtime import faults
from seqtrain.runtime.dist import DistContext
from seqtrain.runtime.precision import MasterWeights, MixedPrecision
from seqtrain.spec.job import SeqTrainJob


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a device-side `found_inf` flag (PyTorch's fused Adam, AdamW and SGD:
    the flag GradScaler sets), so a step with non-finite gradients is skipped without a host sync."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD) or \
            not optimizer.defaults.get("fused"):
        return False
    from torch.distributed.tensor import DTensor

    # FSDP2's sharded parameters are DTensors: a plain flag tensor beside them is not what DTensor dispatch takes
    return not any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


@dataclass
class StepStats:
    """One optimizer step, summed over all micro-batches and all data-parallel ranks."""

    loss_sum: float  # sum of per-token losses
    target_tokens: int  # non-padding target tokens
    slots: int  # token positions computed, padding included
    grad_norm: float  # global L2 norm before clipping
    skipped: bool = False  # the update was skipped (non-finite gradients)
    loss_scale: float | None = None  # fp16 only

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.target_tokens)


class Engine(ABC):
    name = "base"
    # tensor/pipeline parallel: maps the tree between this rank's names and plain slices and the single-process
    # names and full tensors (seqtrain.engine.global_state); None: the tree is already in single-process terms
    global_state: GlobalState | None = None

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        self.job = job
        self.ctx = ctx
        self.model = model  # the bare model (output_weight, blocks/layers); never the wrapper
        self.loss_module = CausalLMLoss(model)
        self.optimizer = build_optimizer(model, job.spec.training.optimizer)
        self.scheduler = build_scheduler(self.optimizer, job.spec.training.schedule, job.spec.training.steps)
        # autocast + fp32 master weights; fp16 adds the dynamic loss scaler (its state is checkpointed)
        self.precision = MixedPrecision(job.spec.optimization.precision, ctx.device)
        self._skips_on_device: bool | None = None  # skips_on_device(self.optimizer), once the engine wrapped it
        self.master: MasterWeights | None = None  # paramDtype bf16: the fp32 masters of the bf16 parameters

    @property
    def state_module(self) -> nn.Module:
        """What the optimizer steps and checkpoints hold: the model, or with bf16 parameters the module of their
        fp32 masters under the same names."""
        return self.master.module if self.master is not None else self.model

    @abstractmethod
    def step(self, micro_batches: list[Batch]) -> StepStats: ...

    def _shard_trust_ratios(self, tp_names: set[str]) -> None:
        """Tensor parallel: LAMB/LARS compute their trust ratios on the full tensors, not on this rank's slices."""
        if self.ctx.tp_size > 1 and hasattr(self.optimizer, "shard_norms"):
            self.optimizer.shard_norms([p for n, p in self.model.named_parameters() if n in tp_names],
                                       self.ctx.tp_group)

    # ---- the step skeleton shared by the data-parallel engines (native/DDP, FSDP2) -----------------------------

    def _accumulate(self, micro_batches: list[Batch], forward: Callable[[Batch], torch.Tensor],
                    before_micro: Callable[[bool], Any]) -> StepStats:
        """Forward/backward every micro-batch with the global-batch loss normalisation, then `_update`.

        `forward(batch)` returns the micro-batch's loss SUM; `before_micro(last)` returns a context manager that
        controls gradient synchronisation (sync only on the last micro-batch).
        """
        dev = self.ctx.device
        batches = [b.to(dev) for b in micro_batches]
        # The global target-token count is the loss denominator, so it is all-reduced before any backward.
        tokens = torch.stack([b.num_targets() for b in batches]).sum().double()
        self.ctx.all_reduce(tokens, group=self.ctx.dp_group)
        # DDP and FSDP average gradients over dp ranks; x dp_size turns that average back into the global sum.
        scale = (self.ctx.dp_size / tokens.clamp(min=1)).float()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        for i, b in enumerate(batches):
            with before_micro(i == len(batches) - 1):
                with self.precision.autocast():
                    ls = faults.poison_loss(forward(b))  # a no-op unless a drill asks for a NaN loss
                self.precision.backward(ls * scale)  # fp16: x loss scale, so small gradients do not underflow
            loss_sum += ls.detach().double()
        return self._update(batches, loss_sum, tokens)

    def _clip(self) -> torch.Tensor:
        """Global gradient L2 norm before clipping, as a device tensor (clipped in place to training.gradClip)."""
        params = [p for p in self.state_module.parameters() if p.grad is not None]
        clip = self.job.spec.training.grad_clip
        return torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf)

    def _update(self, batches: list[Batch], loss_sum: torch.Tensor, tokens: torch.Tensor) -> StepStats:
        """Clip, step the optimizer and the schedule; return the step's global figures.

        Host syncs (the CPU waits for the GPU) are the only ones listed here; everything else stays queued on the
        device, so the CPU launches the optimizer while backward still runs:
        - fp16 only: the loss scaler's overflow flag (`unscale_and_check`), read before the update it decides;
        - an optimizer that skips on device (`skips_on_device`: fused AdamW/Adam/SGD, what CUDA runs) gets the
          non-finite flag as a device tensor, and the figures are read once, after `optimizer.step()` was queued;
        - any other optimizer needs the norm on the host to decide whether to step: one read before the step.
        """
        if self.master is not None:  # paramDtype bf16: clip and update the fp32 masters with fp32 gradients
            self.master.step_grads()
        stats = self._clip_and_step(batches, loss_sum, tokens)
        self.precision.update(stats.skipped)  # fp16: halve the scale after an overflow, grow after a good run
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats.loss_scale = self.precision.loss_scale
        return stats

    def _clip_and_step(self, batches: list[Batch], loss_sum: torch.Tensor, tokens: torch.Tensor) -> StepStats:
        """`_update` without the schedule: unscale (fp16), clip, all-reduce the figures, step unless non-finite."""
        overflow = self.precision.unscale_and_check(self.model.parameters())  # sync: fp16's scaler only
        grad_norm = self._clip()
        # a fill kernel with the count as its argument: no host-to-device copy (torch.tensor(x, device=cuda) is one)
        slots = torch.full((), float(sum(b.slots for b in batches)), dtype=torch.float64, device=self.ctx.device)
        totals = torch.stack([loss_sum, slots])
        self.ctx.all_reduce(totals, group=self.ctx.dp_group)
        figures = torch.stack([grad_norm.double(), totals[0], tokens.double(), totals[1]])
        if self._skips_on_device is None:
            self._skips_on_device = skips_on_device(self.optimizer)
        if self._skips_on_device and not overflow:
            # The kernel returns early when found_inf is 1 (no update, no weight decay, step count kept), so a
            # non-finite norm skips the update without the CPU ever looking at it.
            self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float().reshape(())  # the step counts' shape
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            self._refresh()
            norm, loss, ntok, nslots = figures.tolist()  # sync: the step's one read, after the update is queued
            skipped = not math.isfinite(norm)
        else:
            norm, loss, ntok, nslots = figures.tolist()  # sync: the update decision needs the norm on the host
            skipped = overflow or not math.isfinite(norm)  # skipping keeps inf/NaN out of the weights
            if not skipped:
                self.optimizer.step()
                self._refresh()
        return StepStats(loss_sum=loss, target_tokens=int(ntok), slots=int(nslots), grad_norm=norm, skipped=skipped)

    def _refresh(self) -> None:
        """bf16 parameters: round the updated (or loaded) fp32 masters into them."""
        if self.master is not None:
            self.master.refresh()

    @property
    def lr(self) -> float:
        """Current peak learning rate (of the first parameter group: matrices)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def train(self) -> None:
        self.loss_module.train()

    def eval(self) -> None:
        self.loss_module.eval()

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> tuple[float, int]:
        """(loss sum, target tokens) over this rank's batches; the caller all-reduces. Leaves the model in eval
        mode; call train() after."""
        self.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        count = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for b in batches:
            b = b.to(self.ctx.device)
            with self.precision.autocast():
                total += self.loss_module(b.tokens, b.targets, b.doc_ids).double()
            count += b.num_targets()
        return float(total), int(count)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.state_module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state_module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._refresh()
        self.scheduler.load_state_dict(state["scheduler"])
        self._reapply_schedule()
        if state.get("precision"):
            self.precision.load_state_dict(state["precision"])

    def _reapply_schedule(self) -> None:
        """Set each group's lr from the *current* schedule at the restored step.

        The optimizer state carries the lr of the schedule it was saved under; a resume with another
        `training.steps` (or schedule) must use the new one from its first step. Same formula as LambdaLR.step, so
        an unchanged schedule resumes bit-exactly.
        """
        lambdas = getattr(self.scheduler, "lr_lambdas", None)
        if not lambdas:
            return
        for group, base, fn in zip(self.optimizer.param_groups, self.scheduler.base_lrs, lambdas, strict=True):
            group["lr"] = base * fn(self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def _dcp_group(self) -> Any:
        """The process group DCP loads on: every rank (None: one process)."""
        import torch.distributed as dist

        return dist.group.WORLD if self.ctx.distributed else None

    def checkpoint_state(self) -> dict[str, Any]:
        """The layout-independent tree (`seqtrain.checkpoint.dcp_format`): DCP-ready, by single-process names.
        Collective on sharded engines. The tensors are the live ones: the manager copies them for async saves."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        tree = {"model": get_model_state_dict(self.state_module, options=opts),
                "optim": get_optimizer_state_dict(self.state_module, self.optimizer, options=opts),
                "scheduler": self.scheduler.state_dict(), "precision": self.precision.state_dict()}
        return self.global_state.to_global(tree) if self.global_state is not None else tree

    def load_state(self, folder: str) -> None:
        """Resume from a DCP folder any layout-independent engine wrote, at any data-parallel size."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from seqtrain.checkpoint import dcp_format

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        target = self.checkpoint_state()
        dcp_format.read(folder, target, self._dcp_group())
        if self.global_state is not None:
            target = self.global_state.to_local(target)
        set_model_state_dict(self.state_module, target["model"], options=opts)
        set_optimizer_state_dict(self.state_module, self.optimizer, target["optim"], options=opts)
        self._refresh()
        self.scheduler.load_state_dict(target["scheduler"])
        self._reapply_schedule()
        if target.get("precision"):
            self.precision.load_state_dict(target["precision"])

    def load(self, directory: str) -> None:
        """Resume from a step folder's DCP tree; a folder without one is unusable (set aside, not retried)."""
        from seqtrain.checkpoint import dcp_format
        from seqtrain.checkpoint.safe_load import UnusableCheckpoint

        if not dcp_format.has_state(directory):
            raise UnusableCheckpoint(f"{directory}: no {dcp_format.STATE_DIR}/ folder: not a checkpoint seqtrain "
                                     "resumes (only the DCP format is read): use a new checkpoint folder")
        self.load_state(os.path.join(directory, dcp_format.STATE_DIR))
