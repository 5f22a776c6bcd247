"""The operator's settings (frozen): built once by `main()` from the command line, or by a test, and read by every
pass. What the operator learns while it runs lives elsewhere: per job in k8s/cache/memory.py, process-wide in the
`Runtime` (k8s/process/runtime.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.pods.observe import TERMINATION_OVERDUE_SECONDS


@dataclass(frozen=True)
class WebhookConfig:
    port: int = 9443
    certfile: str | None = None
    keyfile: str | None = None
    insecure: bool = False  # plain HTTP: tests only


@dataclass(frozen=True)
class Settings:
    pods: m.Settings = field(default_factory=m.Settings)  # what the pods are built with (manifests.py)
    node_lost_grace: float = 40.0  # a node NotReady this long counts as lost for its pods
    # a pod Terminating this long past its grace period on a Ready node is force-deleted (observe.replica_of)
    termination_overdue: float = TERMINATION_OVERDUE_SECONDS
    running_poll: float = 10.0  # look again this often while a gang runs (progress, hangs)
    idle_poll: float = 60.0  # and this often otherwise (events wake the loop sooner)
    progress_timeout: float = 2.0
    poll_progress: bool = True
    # Progress alone (the step moving on) is written at most this often per job; a phase, a condition or a
    # checkpoint at once (with the progress of the moment): N running jobs polled every `running_poll` would
    # otherwise cost N / running_poll status writes a second.
    progress_interval: float = 30.0
    # Progress pushed by rank 0 (k8s/progress/push.py): served on this port (None: not served), used while it is at most
    # `push_fresh` seconds old (rank 0 repeats it every few seconds), else the pass polls.
    push_port: int | None = None
    push_fresh: float = 30.0
    metrics_port: int | None = None  # the operator's own Prometheus /metrics (None: not served)
    webhook: WebhookConfig | None = None  # the validating webhook's server (None: not served)
    api_qps: float = 200.0  # the API client's budget (client.Budget)
    api_burst: int = 400
    workers: int = 64  # passes in flight at most (k8s/passes/workqueue.py)
    creators: int = 16  # gang creations in flight at most (k8s/passes/creations.py)
