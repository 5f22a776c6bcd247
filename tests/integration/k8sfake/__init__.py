"""A stateful Kubernetes API fake over HTTP for the operator's integration tests (see server.py for why not kmock)."""

from .cluster import Cluster
from .server import FakeKubernetes, Fault, wait_for
from .store import ApiError, Resource, Store

__all__ = ["ApiError", "Cluster", "FakeKubernetes", "Fault", "Resource", "Store", "wait_for"]
