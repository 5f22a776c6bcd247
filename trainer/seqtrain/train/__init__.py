"""The training loop on top of every other layer: the Trainer, the per-rank entrypoint, evaluation and early
stopping, and the run's callback list (see docs/architecture.md, "Layers")."""
