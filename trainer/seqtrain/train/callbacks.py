"""The callbacks a run gets from its spec, in the order they must run: observers (obs/) and evaluation.

Order matters because callbacks may add keys to the step's metrics that later ones read (throughput first,
then evaluation, then the writers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from seqtrain.obs.callbacks import ProgressPublisher, PrometheusExporter
from seqtrain.train.evaluation import Evaluation

if TYPE_CHECKING:
    from seqtrain.train.loop import Trainer


def build_callbacks(trainer: Trainer) -> list[Any]:
    from seqtrain.obs.throughput import Throughput

    spec, runtime, ctx = trainer.spec, trainer.runtime, trainer.ctx
    out: list[Any] = [Throughput(trainer)]
    if spec.training.eval.batches > 0:
        out.append(Evaluation(trainer))
    if spec.training.profile is not None:
        from seqtrain.obs.profiler import Profiler

        out.append(Profiler(trainer))
    if runtime.metrics_port is not None:
        out.append(PrometheusExporter(trainer, runtime.metrics_port))
    if ctx.is_main:
        from seqtrain.obs.tensorboard import TensorBoard

        out += [ProgressPublisher(trainer, runtime.progress_port), TensorBoard(trainer)]
    return out
