"""Checkpoints: `<dir>/step-<N>/` folders published atomically. Importing this package needs no torch."""

from __future__ import annotations

from seqtrain.checkpoint.discovery import (
           CheckpointInfo,
           latest_checkpoint,
           latest_step,
           list_checkpoints,
           read_complete,
           step_dir,
)
from seqtrain.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointInfo", "CheckpointManager", "latest_checkpoint", "latest_step", "list_checkpoints",
           "read_complete", "step_dir"]
