"""Planner (pure): job spec + node inventory -> Plan (layout, placement, rank assignment, memory estimate)."""

from .local import local_plan
from .types import Layout, Node, Plan, ReplicaAssignment, Unschedulable

__all__ = ["Layout", "Node", "Plan", "ReplicaAssignment", "Unschedulable", "local_plan"]
