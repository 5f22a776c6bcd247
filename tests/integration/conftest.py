"""Integration fixtures: the real control plane (scripts/testbed.sh) and the operator on it, once per session."""

from testbed.fixtures import node_back, rendezvous_released, seqtrain_operator, testbed  # noqa: F401 (pytest finds fixtures by name here)
