"""Validation on the held-out split, early stopping and the best checkpoint (`spec.training.eval`).

Schedule: every `eval.every` optimizer steps and at the last step (`every: 0`: only at the last step). Each
evaluation reads the same `eval.batches` micro-batches of the validation split (files the training split never
contains, see `seqtrain.data.builtin.in_validation`), shared out over the data-parallel ranks so the figure does
not depend on the layout. Results land in the step's metrics.jsonl line (`val_loss`, `val_perplexity`,
`val_bpb` for byte-level data), so a resumed run replays them to restore the best loss and the patience count.

Decisions (new best, stop) are taken on rank 0 and shared with one all-reduce, so every rank saves and stops
at the same step. A new best is checkpointed at its step (unless the loop saves there anyway), protected from
`checkpoint.keep` pruning and named in `<checkpointDir>/best.json`.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from seqtrain.checkpoint.discovery import read_complete, step_dir
from seqtrain.data import Corpus, DocumentBatches, eval_batches, load_corpus
from seqtrain.obs.progress import write_json_atomic
from seqtrain.runtime.callbacks import BaseCallback
from seqtrain.train.early_stop import EarlyStopper

if TYPE_CHECKING:
    from seqtrain.data import Batch
    from seqtrain.train.loop import Trainer

BEST_FILE = "best.json"
EARLY_STOPPED = "EarlyStopped"


def read_best(checkpoint_dir: str) -> dict[str, Any] | None:
    """`best.json` of a checkpoint folder when it names a complete checkpoint, else None."""
    try:
        with open(os.path.join(checkpoint_dir, BEST_FILE), encoding="utf-8") as f:
            best = json.load(f)
        step = int(best["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return best if read_complete(step_dir(checkpoint_dir, step)) is not None else None


class Evaluation(BaseCallback):
    def __init__(self, trainer: Trainer) -> None:
        spec = trainer.spec.training.eval
        self.every = spec.every
        self.num_batches = spec.batches
        es = spec.early_stopping
        self.stopper = EarlyStopper(es.patience if es else None, es.min_delta if es else 0.0)
        self.byte_level = trainer.spec.data.tokenizer.type == "byte" and trainer.spec.data.source != "synthetic"
        self._batches: list[Batch] = []
        self._pending_best: int | None = None  # a best step whose checkpoint the loop has yet to publish
        self.stop_message = ""

    # ---- schedule and data ------------------------------------------------------------------------------
    def due(self, step: int, total_steps: int) -> bool:
        return step == total_steps or (self.every > 0 and step % self.every == 0)

    def batches(self, trainer: Trainer) -> list[Batch]:
        """This rank's share of the fixed validation micro-batches (built once: the same every evaluation)."""
        if not self._batches:
            every = self._all_batches(trainer, load_corpus(trainer.job, "validation"))
            dp, r = trainer.ctx.dp_size, trainer.ctx.dp_rank
            self._batches = [b for i, b in enumerate(every) if i % dp == r]
        return self._batches

    def _all_batches(self, trainer: Trainer, corpus: Corpus) -> list[Batch]:
        """The first `batches` micro-batches of the split in corpus order, cut like the training batches:
        document-aware rows (packing, and only the scored tokens of synthetic tasks) when training uses them,
        fixed windows otherwise."""
        d, mbs = trainer.spec.data, trainer.spec.training.micro_batch_size
        if d.packing or d.bucketing or d.max_tokens_per_batch or corpus.loss_mask is not None:
            rows = DocumentBatches(corpus, d.seq_len, mbs, grad_accum=1, shuffle=False, packing=d.packing)
            return [rows.next_step()[0] for _ in range(self.num_batches)]
        return list(eval_batches(corpus, d.seq_len, mbs, self.num_batches))

    # ---- callback hooks ---------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer) -> None:
        self.batches(trainer)
        if trainer.ctx.is_main:
            self._replay(trainer)

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self._publish_pending(trainer)
        if not self.due(step, trainer.total_steps):
            return
        vals = self.evaluate(trainer)
        new_best, stop = self._decide(trainer, step, vals["val_loss"])
        if trainer.ctx.is_main and self.stopper.best_loss is not None:
            vals["best_val_loss"] = self.stopper.best_loss
            vals["best_step"] = self.stopper.best_step
        if new_best:
            self._keep_best(trainer, step)
        if stop:
            trainer.stop_training = True
            trainer.stop_reason = EARLY_STOPPED
            self.stop_message = self.stopper.reason() if trainer.ctx.is_main else "early stopping"
            vals["stop_reason"] = EARLY_STOPPED
            vals["stop_message"] = self.stop_message
        metrics.update({k: v for k, v in vals.items() if k not in ("stop_reason", "stop_message")})
        trainer.log(self._line(step, vals))
        trainer.callbacks.on_eval(trainer, step, vals)

    def on_train_end(self, trainer: Trainer, reason: str) -> None:
        self._publish_pending(trainer)

    # ---- evaluation -------------------------------------------------------------------------------------
    def evaluate(self, trainer: Trainer) -> dict[str, Any]:
        """Mean validation loss over all ranks' shares; leaves the model in training mode."""
        t0 = time.perf_counter()
        loss_sum, count = trainer.engine.eval_loss(self.batches(trainer))
        trainer.engine.train()
        totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64, device=trainer.ctx.device)
        trainer.ctx.all_reduce(totals, group=trainer.ctx.dp_group)
        loss = float(totals[0] / totals[1].clamp(min=1))
        out: dict[str, Any] = {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0))}
        if self.byte_level:
            out["val_bpb"] = loss / math.log(2)  # nats per byte -> bits per byte
        out["val_tokens"] = int(totals[1])
        out["eval_time_s"] = time.perf_counter() - t0
        return out

    def _decide(self, trainer: Trainer, step: int, loss: float) -> tuple[bool, bool]:
        """Rank 0 updates the stopper; every rank receives its (new best, stop) verdict."""
        flags = torch.zeros(2, dtype=torch.float64, device=trainer.ctx.device)
        if trainer.ctx.is_main:
            new_best = self.stopper.update(step, loss)
            flags[0], flags[1] = float(new_best), float(self.stopper.should_stop)
        trainer.ctx.all_reduce(flags, op="max")
        return bool(flags[0] > 0), bool(flags[1] > 0)

    # ---- best checkpoint --------------------------------------------------------------------------------
    def _keep_best(self, trainer: Trainer, step: int) -> None:
        trainer.checkpoints.protected = {step}  # the previous best may now be pruned like any other
        if trainer.checkpoint_due() or trainer.stop_training or trainer.terminate_requested:
            self._pending_best = step  # the loop saves this step right after the callbacks
        elif trainer.save_checkpoint() is not None:  # None: storage not shared, no checkpoints in this run
            self._mark_best(trainer, step)

    def _publish_pending(self, trainer: Trainer) -> None:
        if self._pending_best is not None and os.path.isdir(step_dir(trainer.runtime.checkpoint_dir, self._pending_best)):
            self._mark_best(trainer, self._pending_best)
            self._pending_best = None

    def _mark_best(self, trainer: Trainer, step: int) -> None:
        if trainer.ctx.is_main:
            write_json_atomic(
                os.path.join(trainer.runtime.checkpoint_dir, BEST_FILE),
                {"step": step, "val_loss": self.stopper.best_loss, "path": f"step-{step}"},
            )

    def _replay(self, trainer: Trainer) -> None:
        """Restore best loss and patience from the evaluations already in metrics.jsonl (truncated to the
        resumed step by the loop), and keep protecting the best checkpoint."""
        path = os.path.join(trainer.runtime.workdir, "metrics.jsonl")
        if not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("val_loss"), (int, float)):
                    self.stopper.update(int(rec["step"]), float(rec["val_loss"]))
        best = read_best(trainer.runtime.checkpoint_dir)
        if best is not None and best["step"] == self.stopper.best_step:
            trainer.checkpoints.protected = {int(best["step"])}

    def _line(self, step: int, v: dict[str, Any]) -> str:
        extra = f" bpb {v['val_bpb']:.3f}" if "val_bpb" in v else ""
        best = f" (best {v['best_val_loss']:.4f} @ {v['best_step']})" if "best_val_loss" in v else ""
        stop = f"; early stop: {v['stop_message']}" if "stop_reason" in v else ""
        return f"eval step {step}: val_loss {v['val_loss']:.4f} ppl {v['val_perplexity']:.2f}{extra}{best}{stop}"
