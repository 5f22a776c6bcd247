"""Restart delay: exponential in the number of restarts so far, capped."""

from __future__ import annotations

import math

from seqtrain.spec.cluster import FaultToleranceSpec


def backoff_seconds(ft: FaultToleranceSpec, restart_number: int) -> float:
    """Delay before restart number `restart_number` (1 = the first restart): backoff * 2**(n-1), at most
    maxBackoffSeconds. restart_number < 1 is treated as 1."""
    n = max(1, restart_number)
    try:  # backoff * 2**(n-1) exactly, for any n: a fixed cap on the exponent broke the doubling for tiny backoffs
        delay = math.ldexp(ft.backoff_seconds, n - 1)
    except OverflowError:
        delay = math.inf
    return float(min(delay, ft.max_backoff_seconds))
