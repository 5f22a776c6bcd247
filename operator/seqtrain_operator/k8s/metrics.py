"""Prometheus metrics of the operator (not of training: the trainer exports its own)."""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client import Counter as PromCounter

PHASES = ("Pending", "Scheduling", "Running", "Restarting", "Succeeded", "Failed", "Suspended")


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.jobs = Gauge("seqtrain_jobs", "SeqTrainJobs by phase (as last reconciled).", ["phase"],
                          registry=self.registry)
        self.restarts = PromCounter("seqtrain_gang_restarts", "Gang restarts by failure class.", ["kind"],
                                    registry=self.registry)
        self.reconcile_seconds = Histogram("seqtrain_reconcile_seconds", "Time of one reconcile pass.",
                                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                           registry=self.registry)
        self.reconcile_errors = PromCounter("seqtrain_reconcile_errors", "Reconcile passes that raised.",
                                            ["error"], registry=self.registry)
        self._phase: dict[tuple[str, str], str] = {}

    def job_phase(self, namespace: str, name: str, phase: str | None) -> None:
        key = (namespace, name)
        if phase is None:
            self._phase.pop(key, None)
        else:
            self._phase[key] = phase
        counts = Counter(self._phase.values())
        for p in PHASES:
            self.jobs.labels(phase=p).set(counts.get(p, 0))

    def restarted(self, user: int, infra: int) -> None:
        if user > 0:
            self.restarts.labels(kind="user").inc(user)
        if infra > 0:
            self.restarts.labels(kind="infrastructure").inc(infra)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
