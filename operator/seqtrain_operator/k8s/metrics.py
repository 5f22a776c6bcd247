"""Prometheus metrics of the operator (not of training steps: the trainer exports its own), and per job what the
status says: goodput, where the wall time went (status.lostSeconds), progress and restarts."""

from __future__ import annotations

from collections import Counter
from contextlib import suppress

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client import Counter as PromCounter

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
        # A pass whose gang waits for capacity awaits the next admission cycle (k8s/admission.py): queueing, kept
        # out of the pass's own time above.
        self.admission_wait_seconds = Histogram(
            "seqtrain_admission_wait_seconds", "Time a pass waited for its gang's admission cycle.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry)
        self.admission_cycle_seconds = Histogram(
            "seqtrain_admission_cycle_seconds", "Time of one admission cycle (every waiting gang planned).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=self.registry)
        self.workqueue_depth = Gauge("seqtrain_workqueue_depth", "Jobs queued for a pass, not yet taken by a "
                                     "worker (k8s/workqueue.py).", registry=self.registry)
        self.reconcile_errors = PromCounter("seqtrain_reconcile_errors", "Reconcile passes that raised.",
                                            ["error"], registry=self.registry)
        self._phase: dict[tuple[str, str], str] = {}
        job = ("namespace", "job")
        r = self.registry
        self.goodput = Gauge("seqtrain_job_goodput_ratio", "Share of the job's wall time that trained kept steps "
                             "(status.goodput).", job, registry=r)
        self.productive = Gauge("seqtrain_job_productive_seconds", "Wall time that trained kept steps "
                                "(status.productiveSeconds).", job, registry=r)
        self.lost = Gauge("seqtrain_job_lost_seconds", "Wall time that did not train, by reason "
                          "(status.lostSeconds); with productive seconds it adds up to the wall time.",
                          [*job, "reason"], registry=r)
        self.step = Gauge("seqtrain_job_step", "Last completed step as the operator last saw it.", job, registry=r)
        self.total_steps = Gauge("seqtrain_job_total_steps", "Steps the job trains (spec.training.steps).", job,
                                 registry=r)
        self.tokens_per_second = Gauge("seqtrain_job_tokens_per_second", "Real tokens per second of the last step "
                                       "(all ranks).", job, registry=r)
        self.job_restarts = Gauge("seqtrain_job_restarts", "Gang restarts of the job by failure class "
                                  "(status.restarts, status.infraRestarts).", [*job, "kind"], registry=r)
        # What a failure now would lose (status.workAtRisk): what a person (or a script choosing a victim to
        # preempt) reads to prefer the job that loses least; absent until the trainer reports it.
        self.at_risk_seconds = Gauge("seqtrain_job_work_at_risk_seconds", "Training seconds since the latest "
                                     "complete checkpoint (status.workAtRisk.seconds).", job, registry=r)
        self.at_risk_steps = Gauge("seqtrain_job_work_at_risk_steps", "Steps trained since the latest complete "
                                   "checkpoint (status.workAtRisk.steps).", job, registry=r)
        self.checkpoint_age = Gauge("seqtrain_job_checkpoint_age_seconds", "Wall seconds since the latest complete "
                                    "checkpoint was saved (status.workAtRisk.checkpointAgeSeconds).", job,
                                    registry=r)
        self._per_job = (self.goodput, self.productive, self.step, self.total_steps, self.tokens_per_second,
                         self.at_risk_seconds, self.at_risk_steps, self.checkpoint_age)

    def job_phase(self, namespace: str, name: str, phase: str | None) -> None:
        key = (namespace, name)
        if phase is None:
            self._phase.pop(key, None)
        else:
            self._phase[key] = phase
        counts = Counter(self._phase.values())
        for p in PHASES:
            self.jobs.labels(phase=p).set(counts.get(p, 0))

    def job_status(self, namespace: str, name: str, st: JobStatus | None) -> None:
        """The job's figures as its last pass decided them (None: the job is gone, so are its series)."""
        lv = {"namespace": namespace, "job": name}
        if st is None:
            for g in self._per_job:
                _remove(g, namespace, name)
            for reason in LostSeconds.model_fields:
                _remove(self.lost, namespace, name, _camel(reason))
            for kind in ("user", "infrastructure"):
                _remove(self.job_restarts, namespace, name, kind)
            return
        if st.goodput is not None:
            self.goodput.labels(**lv).set(st.goodput)
        if st.productive_seconds is not None:
            self.productive.labels(**lv).set(st.productive_seconds)
        if st.lost_seconds is not None:
            for reason, seconds in st.lost_seconds.model_dump().items():
                self.lost.labels(**lv, reason=_camel(reason)).set(seconds)
        if st.progress is not None:
            self.step.labels(**lv).set(st.progress.step)
            self.total_steps.labels(**lv).set(st.progress.total_steps)
            if st.progress.tokens_per_second is not None:
                self.tokens_per_second.labels(**lv).set(st.progress.tokens_per_second)
        risk = st.work_at_risk
        if risk is not None:
            self.at_risk_seconds.labels(**lv).set(risk.seconds)
            self.at_risk_steps.labels(**lv).set(risk.steps)
            if risk.checkpoint_age_seconds is not None:
                self.checkpoint_age.labels(**lv).set(risk.checkpoint_age_seconds)
        self.job_restarts.labels(**lv, kind="user").set(st.restarts)
        self.job_restarts.labels(**lv, kind="infrastructure").set(st.infra_restarts)

    def restarted(self, user: int, infra: int) -> None:
        if user > 0:
            self.restarts.labels(kind="user").inc(user)
        if infra > 0:
            self.restarts.labels(kind="infrastructure").inc(infra)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)


def _camel(name: str) -> str:
    """The reason as status.lostSeconds spells it (checkpoint_stall -> checkpointStall)."""
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


def _remove(gauge: Gauge, *labels: str) -> None:
    with suppress(KeyError):  # never set for this job
        gauge.remove(*labels)
