"""The operator's per-job series say what the status says, work at risk included (what a person or a script
choosing a job to preempt reads), and a deleted job's series go with it."""

from __future__ import annotations

from seqtrain.spec.status import JobStatus, WorkAtRisk
from seqtrain_operator.k8s.metrics import OperatorMetrics


def _value(m: OperatorMetrics, name: str) -> float | None:
    return m.registry.get_sample_value(name, {"namespace": "team", "job": "llm"})


def test_work_at_risk_and_checkpoint_age_are_exported_per_job_and_removed_with_it():
    m = OperatorMetrics()
    m.job_status("team", "llm", JobStatus(phase="Running"))
    assert _value(m, "seqtrain_job_work_at_risk_seconds") is None  # not reported yet: no series, not a zero
    at_risk = WorkAtRisk(checkpoint_step=200, steps=37, seconds=412.5, checkpoint_age_seconds=431.0)
    m.job_status("team", "llm", JobStatus(phase="Running", work_at_risk=at_risk))
    assert _value(m, "seqtrain_job_work_at_risk_seconds") == 412.5
    assert _value(m, "seqtrain_job_work_at_risk_steps") == 37
    assert _value(m, "seqtrain_job_checkpoint_age_seconds") == 431.0
    m.job_status("team", "llm", None)
    for name in ("seqtrain_job_work_at_risk_seconds", "seqtrain_job_work_at_risk_steps",
                 "seqtrain_job_checkpoint_age_seconds"):
        assert _value(m, name) is None, name
