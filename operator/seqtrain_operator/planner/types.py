"""Plan data: what the planner decides and the backends execute. Plain frozen dataclasses, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Node:
    """One schedulable machine as the planner sees it (free capacity, after running pods' requests)."""

    name: str
    gpus: int = 0
    cpu_millis: int = 0
    memory_bytes: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    schedulable: bool = True
    ready: bool = True
    # (key, value, effect) of the node's taints; effect NoSchedule/NoExecute must be tolerated by the pods.
    taints: tuple[tuple[str, str, str], ...] = ()
    pods: int | None = None  # free pod slots (allocatable "pods" minus the pods on it); None: not limited
    other: dict[str, int] = field(default_factory=dict)  # free ephemeral-storage bytes and extended resources


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class ReplicaAssignment:
    replica: int
    node: str
    ranks: tuple[int, ...]
    # Topology domain of the node (label values of scheduling.topology.keys, outermost first); () when unknown.
    domain: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    world_size: int
    procs_per_replica: int
    layout: Layout
    replicas: tuple[ReplicaAssignment, ...]
    # Human-readable reasons the plan looks the way it does (memory estimate, ZeRO choice ...).
    notes: tuple[str, ...] = ()

    def ranks_of(self, replica: int) -> tuple[int, ...]:
        return self.replicas[replica].ranks


@dataclass(frozen=True)
class Unschedulable:
    """No placement fits: the gang must not start. `reason` is shown in the job's Scheduling condition."""

    reason: str
