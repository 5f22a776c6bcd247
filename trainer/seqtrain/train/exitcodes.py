"""Exit codes of `seqtrain train`: the controller classifies a rank's end by them."""

from __future__ import annotations

OK = 0
ERROR = 1  # anything unexpected: retryable (restart the gang from the latest checkpoint)
INVALID_CONFIG = 3  # the config cannot work; restarting will not help (permanent)
COMM_TIMEOUT = 4  # a collective timed out: a peer hung or died (retryable, likely infrastructure)
DEVICE_UNAVAILABLE = 5  # a GPU job sees no CUDA device: the node is broken (infrastructure; avoid the node)
TERMINATED = 143  # SIGTERM received; the current step finished and a checkpoint was saved (128 + 15)

RETRYABLE = frozenset({ERROR, COMM_TIMEOUT, DEVICE_UNAVAILABLE, TERMINATED})
PERMANENT = frozenset({INVALID_CONFIG})


class InvalidConfig(Exception):
    """The trainer config is unusable; the message names the field and the fix. Exits INVALID_CONFIG."""


class DeviceUnavailable(Exception):
    """The job asks for GPUs but this process sees none: the node (driver, device plugin), not the config, is at
    fault. Exits DEVICE_UNAVAILABLE: the operator restarts the gang elsewhere."""
