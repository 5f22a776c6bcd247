"""Restart delay: exponential in the number of restarts so far, capped."""

from __future__ import annotations

from seqtrain.spec.cluster import FaultToleranceSpec


def backoff_seconds(ft: FaultToleranceSpec, restart_number: int) -> float:
    """Delay before restart number `restart_number` (1 = the first restart): backoff * 2**(n-1), at most
    maxBackoffSeconds. restart_number < 1 is treated as 1."""
    n = max(1, restart_number)
    # Cap the exponent before computing: 2**10000 is fine for ints but float(...) of it overflows.
    exp = min(n - 1, 64)
    return float(min(ft.backoff_seconds * (2.0**exp), ft.max_backoff_seconds))
