"""Pipeline parallel (torch.distributed.pipelining) with data parallel across pipeline replicas and optional
tensor parallel inside each stage.

Per step, on every rank of a pipeline: the step's sequences for this data-parallel rank (all of the loop's
micro-batches, concatenated) are split into `optimization.microBatches` pipeline micro-batches and driven
through the schedule (GPipe, 1F1B or interleaved 1F1B with two model chunks per rank). The loss function
returns each micro-batch's loss SUM / the global target-token count (`scale_grads=False`), so the summed
gradients equal the single-process ones. Afterwards: tied-embedding gradients summed between the first and
last stage, gradients summed over the data-parallel group (flat buckets), then `Engine._update`: mesh-wide norm
and clipping, the step (skipped on device by a fused optimizer), the schedule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from seqtrain.data import Batch
from seqtrain.engine.base import Engine, StepStats
from seqtrain.engine.global_state import GlobalState
from seqtrain.layout.rules import pipeline_micro_batches
from seqtrain.layout.topology import INTERLEAVED_CHUNKS
from seqtrain.parallel.grads import all_reduce_grads, clip_grad_norm
from seqtrain.parallel.pipeline import (
    TIED_COPY,
    Stage,
    build_stages,
    check_stage_device,
    layout,
    schedule_class,
)
from seqtrain.parallel.tensor import tp_param_names, tp_shard_dims
from seqtrain.runtime.dist import DistContext
from seqtrain.spec.job import SeqTrainJob


class PipelineEngine(Engine):
    name = "native-pp"

    def __init__(self, model: nn.Module, job: SeqTrainJob, ctx: DistContext) -> None:
        from torch.distributed.pipelining import PipelineStage

        opt = job.spec.optimization
        pp = ctx.pp_size
        self.chunks = INTERLEAVED_CHUNKS if opt.pipeline_schedule == "interleaved" else 1
        n_stages = pp * self.chunks
        # interleaved: rank r holds stages r, r + pp, ... (the schedule's loop order)
        bounds, self.stage_ids = layout(job, pp, ctx.pp_rank)
        self.stages: list[Stage] = build_stages(model, bounds, self.stage_ids)
        if not any(s.first for s in self.stages) and hasattr(model, "embed"):
            model.embed.to(torch.device("meta"))  # the last stage copied it (tied): free the device memory
        container = nn.ModuleDict({f"stage{i}": s for i, s in zip(self.stage_ids, self.stages, strict=True)})
        self.tp_names = {f"stage{i}.{n}" for i in self.stage_ids for n in _stage_tp_names(model, bounds[i])}
        super().__init__(container, job, ctx)
        self._shard_trust_ratios(self.tp_names)
        self.first_stage = next((s for s in self.stages if s.first), None)
        self.last_stage = next((s for s in self.stages if s.last), None)
        self.n_micro = pipeline_micro_batches(job)
        self.grad_clip = job.spec.training.grad_clip
        for s in self.stages:
            check_stage_device(s, ctx.device)
        self.pipe_stages = [PipelineStage(s, i, n_stages, ctx.device, group=ctx.pp_group)
                            for i, s in zip(self.stage_ids, self.stages, strict=True)]
        self.schedule_name = opt.pipeline_schedule
        self._schedules: dict[int, Any] = {}
        self._scale = 1.0
        # tied embeddings across stages: first and last stage each hold a copy (see seqtrain.parallel.pipeline)
        self.tied = pp > 1 and getattr(model, "lm_head", None) is None
        # the last stage's copy has the same gradient as the first stage's: count it once in the norm
        self.skip_names = {f"stage{self.stage_ids[-1]}.{TIED_COPY}"} if self.tied and self.last_stage else set()
        # checkpoints: the stages' parameters under the single-process names (the tied copy is the embedding),
        # tensor-parallel slices as parts of the full tensors (seqtrain.engine.global_state)
        mesh = ctx.mesh["tp"] if ctx.mesh is not None and ctx.tp_size > 1 else None
        self.global_state = GlobalState(container, _single_process_name, tp_shard_dims(model), mesh)

    # ---- the schedule ------------------------------------------------------------------------------------
    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.last_stage is not None
        return self.last_stage.loss_sum(output, target) * self._scale

    def _schedule(self, n_micro: int) -> Any:
        if n_micro not in self._schedules:
            cls = schedule_class(self.schedule_name)
            target = self.pipe_stages if self.chunks > 1 else self.pipe_stages[0]
            self._schedules[n_micro] = cls(target, n_microbatches=n_micro, loss_fn=self._loss_fn, scale_grads=False)
        return self._schedules[n_micro]

    def _run(self, tokens: torch.Tensor, targets: torch.Tensor, n_micro: int, train: bool) -> torch.Tensor:
        """Drive the schedule; return the loss SUM of the step on the last stage's rank (0 elsewhere)."""
        sched = self._schedule(n_micro)
        args = (tokens,) if self.first_stage is not None else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.last_stage is not None else {}
        with self.precision.autocast():
            if train:
                sched.step(*args, **kwargs)
            else:
                sched.eval(*args, **kwargs)
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        # the schedule returns loss_fn's values (sum / global tokens): undo the scale for the report
        return torch.stack([x.detach().double() for x in losses]).sum() / self._scale

    def step(self, micro_batches: list[Batch]) -> StepStats:
        dev = self.ctx.device
        batches = [b.to(dev) for b in micro_batches]
        if any(b.doc_ids is not None for b in batches):
            raise ValueError("packed sequences (doc_ids) are not supported with pipeline parallel")
        tokens = torch.cat([b.tokens for b in batches])
        targets = torch.cat([b.targets for b in batches])
        count = torch.stack([b.num_targets() for b in batches]).sum().double()
        self.ctx.all_reduce(count, group=self.ctx.dp_group)
        self._scale = 1.0 / count.clamp(min=1.0)  # a device tensor: the loss function needs no host value
        loss_sum = self._run(tokens, targets, self.n_micro, train=True)
        if self.tied:
            self._sync_tied()
        if self.ctx.dp_size > 1:
            all_reduce_grads(list(self.model.parameters()), self.ctx.dp_group, self.job.spec.optimization.bucket_mb)
        loss_sum = loss_sum.to(dev)
        self.ctx.all_reduce(loss_sum, group=self.ctx.pp_group)  # only the last stage has losses
        # clip, step and schedule as the data-parallel engines do: with a fused optimizer no host read comes
        # before optimizer.step() (the figures are read once, after it is queued)
        return self._update(batches, loss_sum, count)

    def _clip(self) -> torch.Tensor:
        """Mesh-wide gradient norm (every stage and tensor-parallel slice; the tied copy counted once), clipped."""
        return clip_grad_norm(self.model, self.grad_clip, self.ctx, self.tp_names, self.skip_names)

    def _sync_tied(self) -> None:
        """Sum the tied embedding's gradient between its first-stage and last-stage copies."""
        if self.first_stage is not None:
            w = self.first_stage.embed.weight
        elif self.last_stage is not None:
            w = self.last_stage.output.weight
        else:
            return  # middle stages are not in the embedding group
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        self.ctx.all_reduce(w.grad, group=self.ctx.embed_group)

    # ---- evaluation and checkpoints ----------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> tuple[float, int]:
        """Forward-only through the training schedule, in groups of one training step's sequences: the stages
        keep the communication buffers of the training micro-batch shape, so evaluation must reuse it."""
        self.eval()
        dev = self.ctx.device
        batches = [b.to(dev) for b in batches]
        tokens = torch.cat([b.tokens for b in batches])
        targets = torch.cat([b.targets for b in batches])
        step_rows = self.job.spec.training.global_batch_size // self.ctx.dp_size
        if tokens.shape[0] % step_rows:
            raise ValueError(f"pipeline evaluation runs in groups of globalBatchSize / dp = {step_rows} sequences; "
                             f"got {tokens.shape[0]}: make training.eval.batches x microBatchSize a multiple")
        self._scale = 1.0
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for i in range(0, tokens.shape[0], step_rows):
            total += self._run(tokens[i:i + step_rows], targets[i:i + step_rows], self.n_micro, train=False).to(dev)
        # The caller all-reduces over data parallel; make every stage of this pipeline report the same sum.
        self.ctx.all_reduce(total, group=self.ctx.pp_group)
        count = torch.stack([b.num_targets() for b in batches]).sum()
        return float(total), int(count)


def _single_process_name(name: str) -> str:
    """`stage3.blocks.5.attn.q.weight` -> `blocks.5.attn.q.weight` (a Stage keeps the full model's module names);
    the last stage's copy of a tied embedding is the embedding."""
    rest = name.split(".", 1)[1]
    return "embed.weight" if rest == TIED_COPY else rest


def _stage_tp_names(model: nn.Module, bounds: tuple[int, int]) -> set[str]:
    """Tensor-parallel parameter names of the full model, renamed as they appear inside a Stage."""
    names = tp_param_names(model)
    out = set()
    for n in names:
        if n.startswith(("blocks.", "layers.")):
            idx = int(n.split(".")[1])
            if bounds[0] <= idx < bounds[1]:
                out.add(n)
        else:
            out.add(n)
    if "embed.weight" in names:
        out.add(TIED_COPY)
    return out
