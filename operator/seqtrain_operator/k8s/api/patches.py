"""JSON patches the operator sends (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def remove_finalizer_ops(meta: Mapping[str, Any], finalizer: str) -> list[dict[str, Any]] | None:
    """A JSON patch dropping one finalizer, guarded by a test of its list entry (a concurrent change of the
    finalizers makes the patch fail instead of dropping someone else's); None when the finalizer is not there."""
    finalizers = list(meta.get("finalizers") or [])
    if finalizer not in finalizers:
        return None
    i = finalizers.index(finalizer)
    return [{"op": "test", "path": f"/metadata/finalizers/{i}", "value": finalizer},
            {"op": "remove", "path": f"/metadata/finalizers/{i}"}]
