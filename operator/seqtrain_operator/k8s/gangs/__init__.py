"""External gang schedulers, one module each behind `base.GangScheduler` (see base.py for the interface)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from seqtrain_operator.k8s.gangs import coscheduling, kai, kueue, volcano
from seqtrain_operator.k8s.gangs.base import GangScheduler

ADAPTERS: Mapping[str, GangScheduler] = MappingProxyType(
    {a.name: a for a in (coscheduling.ADAPTER, volcano.ADAPTER, kueue.ADAPTER, kai.ADAPTER)})


def adapter_for(gang: str) -> GangScheduler | None:
    """The adapter of `spec.scheduling.gang` (None: native, placed by seqtrain itself)."""
    return ADAPTERS.get(gang)


__all__ = ["ADAPTERS", "GangScheduler", "adapter_for"]
