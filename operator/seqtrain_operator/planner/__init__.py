"""Planner (pure): job spec + node inventory -> Plan (layout, placement, rank assignment, memory estimate)."""

from seqtrain_operator.planner.local import local_plan
from seqtrain_operator.planner.types import Layout, Node, Plan, ReplicaAssignment, Unschedulable

__all__ = ["Layout", "Node", "Plan", "ReplicaAssignment", "Unschedulable", "local_plan"]
