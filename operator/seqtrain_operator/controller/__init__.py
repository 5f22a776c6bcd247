"""Controller core (pure, no I/O), shared by the local backend and the Kubernetes operator.

    decision = decide(job, status, observed, now)
    for action in decision.actions: ...   # CreateGang / DeleteGang / RequeueAfter; Events after the status write
    persist(decision.status)

See `decide.py` for the phase machine and its invariants; it hands each state of the live gang to a policy of its
own: `failed.py` (the failure policy executed: restart or Failed), `succeeded.py`, `running.py` (hangs, elastic
growth), `pending.py` (the waits and their deadlines), and `absent.py` when there is no gang (admit, back off,
re-create), all working on `context.Pass`. `failure_policy.py` classifies failures (user / infrastructure /
disruption / permanent), `gang_policy.py` admits gangs and `backoff.py` spaces restarts.
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
