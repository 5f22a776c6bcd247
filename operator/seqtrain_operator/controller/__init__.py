"""Controller core (pure, no I/O), shared by the local backend and the Kubernetes operator.

    decision = decide(job, status, observed, now)
    for action in decision.actions: ...   # CreateGang / DeleteGang / RequeueAfter; Events after the status write
    persist(decision.status)

See `decide.py` for the phase machine and its invariants, `failure_policy.py` for how failures are classified
(user / infrastructure / permanent), `gang_policy.py` for gang admission and `backoff.py` for restart delays.
"""

from seqtrain_operator.controller.backoff import backoff_seconds
from seqtrain_operator.controller.clock import iso, parse, utcnow
from seqtrain_operator.controller.decide import create_failed, decide
from seqtrain_operator.controller.failure_policy import Failure, FailureClass, classify, root_cause
from seqtrain_operator.controller.types import (
    Action,
    CreateGang,
    Decision,
    DeleteGang,
    DeleteJob,
    Event,
    Observed,
    ReplicaObservation,
    ReplicaPhase,
    RequeueAfter,
)

__all__ = [
    "Action", "CreateGang", "Decision", "DeleteGang", "DeleteJob", "Event", "Observed", "ReplicaObservation",
    "ReplicaPhase", "RequeueAfter", "Failure", "FailureClass", "backoff_seconds", "classify", "create_failed", "decide",
    "iso", "parse",
    "root_cause", "utcnow",
]
