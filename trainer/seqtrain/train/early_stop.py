"""Best-so-far tracking and early stopping on validation loss: pure, replayable from metrics.jsonl."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EarlyStopper:
    """An evaluation improves when its loss is below the best so far by more than `min_delta`; after `patience`
    evaluations in a row without improvement the run should stop. `patience=None`: track the best, never stop."""

    patience: int | None = None
    min_delta: float = 0.0
    best_loss: float | None = None
    best_step: int | None = None
    bad_evals: int = 0

    def update(self, step: int, loss: float) -> bool:
        """Record one evaluation; True when it is the new best."""
        if self.best_loss is None or loss < self.best_loss - self.min_delta:
            self.best_loss, self.best_step, self.bad_evals = loss, step, 0
            return True
        self.bad_evals += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.bad_evals >= self.patience

    def reason(self) -> str:
        return (
            f"validation loss did not improve by more than {self.min_delta:g} for {self.bad_evals} evaluations "
            f"(best {self.best_loss:.4f} at step {self.best_step})"
        )
