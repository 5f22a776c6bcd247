"""Hook points of the training loop: evaluation, TensorBoard, Prometheus, profiling plug in here.

Callbacks run on every rank (a callback that writes files checks `trainer.ctx.is_main` itself; one that runs
collectives, like evaluation, must run on all ranks). `on_step_end` receives the step's metrics dict (the same
keys as a metrics.jsonl line) and may add keys to it: the metrics writer runs last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from seqtrain.train.loop import Trainer


@runtime_checkable
class Callback(Protocol):
    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None: ...

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None: ...

    def on_train_end(self, trainer: Trainer, reason: str) -> None: ...


class BaseCallback:
    """No-op implementations; subclass and override what you need."""

    def on_train_start(self, trainer: Trainer) -> None:
        pass

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        pass

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        pass

    def on_train_end(self, trainer: Trainer, reason: str) -> None:
        """reason: "completed", "terminated" (SIGTERM), "stopped" (a callback asked to stop) or "error"."""


class CallbackList:
    def __init__(self, callbacks: list[Any] | None = None) -> None:
        self.callbacks: list[Any] = list(callbacks or [])

    def append(self, cb: Any) -> None:
        self.callbacks.append(cb)

    def _call(self, name: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, name, None)
            if fn is not None:
                fn(*args)

    def on_train_start(self, trainer: Trainer) -> None:
        self._call("on_train_start", trainer)

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self._call("on_step_end", trainer, step, metrics)

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        self._call("on_eval", trainer, step, metrics)

    def on_train_end(self, trainer: Trainer, reason: str) -> None:
        self._call("on_train_end", trainer, reason)
