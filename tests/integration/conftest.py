"""Integration fixtures: the real control plane (scripts/testbed.sh) and the operator on it, once per session."""

from testbed.fixtures import (  # noqa: F401 (pytest finds fixtures and hooks by name here)
    node_back,
    pytest_runtest_makereport,
    rendezvous_released,
    seqtrain_operator,
    testbed,
)
