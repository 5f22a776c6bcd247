"""Checkpoints: `<dir>/step-<N>/` folders published atomically. Importing this package needs no torch."""

from __future__ import annotations

from .discovery import (
           CheckpointInfo,
           latest_checkpoint,
           latest_step,
           list_checkpoints,
           read_complete,
           step_dir,
)
from .manager import CheckpointManager

__all__ = ["CheckpointInfo", "CheckpointManager", "latest_checkpoint", "latest_step", "list_checkpoints",
           "read_complete", "step_dir"]
