"""Prometheus metrics of the operator (not of training steps: the trainer exports its own), and per job what the
status says: goodput, where the wall time went (status.lostSeconds), progress and restarts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from seqtrain.obs import httpserve
from seqtrain.spec.status import JobStatus, LostSeconds

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
        # A pass whose gang waits for capacity awaits the next admission cycle (k8s/capacity/admission.py): queueing,
        # kept out of the pass's own time above.
        self.admission_wait_seconds = Histogram(
            "seqtrain_admission_wait_seconds", "Time a pass waited for its gang's admission cycle.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry)
        self.admission_cycle_seconds = Histogram(
            "seqtrain_admission_cycle_seconds", "Time of one admission cycle (every waiting gang planned).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=self.registry)
        # A gang's creation runs beside the passes (k8s/passes/creations.py): from the pass that handed it off to its
        # last object created, waits for the API client's bulk lane included.
        self.gang_create_seconds = Histogram(
            "seqtrain_gang_create_seconds", "Time to create a gang's objects, from its admission's pass.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=self.registry)
        self.workqueue_depth = Gauge("seqtrain_workqueue_depth", "Jobs queued for a pass, not yet taken by a "
                                     "worker (k8s/passes/workqueue.py).", registry=self.registry)
        self.reconcile_errors = PromCounter("seqtrain_reconcile_errors", "Reconcile passes that raised.",
                                            ["error"], registry=self.registry)
        self._phase: dict[tuple[str, str], str] = {}
        self._phases: Counter[str] = Counter()
        for p in PHASES:  # every phase's series from the start, 0 until a job is in it
            self.jobs.labels(phase=p)
        self.per_job = JobSeries()
        self.registry.register(self.per_job)

    def job_phase(self, namespace: str, name: str, phase: str | None) -> None:
        key = (namespace, name)
        old = self._phase.pop(key, None) if phase is None else self._phase.get(key)
        if phase is not None:
            self._phase[key] = phase
        if old == phase:
            return
        if old is not None:
            self._phases[old] -= 1
        if phase is not None:
            self._phases[phase] += 1
        for p in (old, phase):
            if p is not None:
                self.jobs.labels(phase=p).set(self._phases[p])

    def job_status(self, namespace: str, name: str, st: JobStatus | None) -> None:
        """The job's figures as its last pass decided them (None: the job is gone, so are its series)."""
        self.per_job.record(namespace, name, st)

    def restarted(self, user: int, infra: int) -> None:
        if user > 0:
            self.restarts.labels(kind="user").inc(user)
        if infra > 0:
            self.restarts.labels(kind="infrastructure").inc(infra)

    def serve(self, port: int, addr: str = "0.0.0.0") -> httpserve.BoundedServer:
        """Serve `/metrics` on a daemon thread with the trainer's bounded server (seqtrain.obs.httpserve): a deadline
        per connection, a cap on connections, no request body. It shares the process with the watches and the push
        endpoint, so a client must not be able to hold its threads or descriptors. A taken port raises."""

        def scrape() -> tuple[int, str, bytes]:
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)

        server = httpserve.BoundedServer((addr, port), {"/metrics": scrape, "/": scrape})
        httpserve.start(server, "metrics")
        return server


def _camel(name: str) -> str:
    """The reason as status.lostSeconds spells it (checkpoint_stall -> checkpointStall)."""
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


_LOST = tuple(LostSeconds.model_fields)
# (series, help, extra label): one gauge per job (and per value of the extra label); the values come from `_row`
_FAMILIES = (
    ("seqtrain_job_goodput_ratio", "Share of the job's wall time that trained kept steps (status.goodput).", None),
    ("seqtrain_job_productive_seconds", "Wall time that trained kept steps (status.productiveSeconds).", None),
    ("seqtrain_job_lost_seconds", "Wall time that did not train, by reason (status.lostSeconds); with productive "
     "seconds it adds up to the wall time.", "reason"),
    ("seqtrain_job_step", "Last completed step as the operator last saw it.", None),
    ("seqtrain_job_total_steps", "Steps the job trains (spec.training.steps).", None),
    ("seqtrain_job_tokens_per_second", "Real tokens per second of the last step (all ranks).", None),
    ("seqtrain_job_restarts", "Gang restarts of the job by failure class (status.restarts, status.infraRestarts).",
     "kind"),
    # What a failure now would lose (status.workAtRisk): what a person (or a script choosing a victim to preempt)
    # reads to prefer the job that loses least; absent until the trainer reports it.
    ("seqtrain_job_work_at_risk_seconds", "Training seconds since the latest complete checkpoint "
     "(status.workAtRisk.seconds).", None),
    ("seqtrain_job_work_at_risk_steps", "Steps trained since the latest complete checkpoint "
     "(status.workAtRisk.steps).", None),
    ("seqtrain_job_checkpoint_age_seconds", "Wall seconds since the latest complete checkpoint was saved "
     "(status.workAtRisk.checkpointAgeSeconds).", None),
)


def _row(st: JobStatus) -> tuple[Any, ...]:
    """What the series need of a status, one item per family in `_FAMILIES` order (None: no series; pairs of
    (label, value) for a labelled one)."""
    progress, risk, lost = st.progress, st.work_at_risk, st.lost_seconds
    return (st.goodput, st.productive_seconds,
            None if lost is None else tuple((_camel(r), getattr(lost, r)) for r in _LOST),
            None if progress is None else progress.step, None if progress is None else progress.total_steps,
            None if progress is None else progress.tokens_per_second,
            (("user", st.restarts), ("infrastructure", st.infra_restarts)),
            None if risk is None else risk.seconds, None if risk is None else risk.steps,
            None if risk is None else risk.checkpoint_age_seconds)


class JobSeries(Collector):
    """The per-job series, built when Prometheus scrapes, from one small tuple per job (`_row`). A prometheus_client
    Gauge child per job and series (about a dozen per job, each with its lock) took 7.5 MiB per 1000 jobs, measured,
    for values read once per scrape."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], tuple[Any, ...]] = {}

    def record(self, namespace: str, name: str, st: JobStatus | None) -> None:
        if st is None:
            self.rows.pop((namespace, name), None)
        else:
            self.rows[(namespace, name)] = _row(st)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = list(self.rows.items())  # a scrape runs in the metrics server's thread
        for i, (series, help_, extra) in enumerate(_FAMILIES):
            family = GaugeMetricFamily(series, help_, labels=["namespace", "job", *([extra] if extra else [])])
            for (namespace, name), row in rows:
                if (value := row[i]) is None:
                    continue
                if extra:
                    for label, v in value:
                        family.add_metric([namespace, name, label], v)
                else:
                    family.add_metric([namespace, name], value)
            yield family
