"""The operator's per-job series say what the status says, work at risk included (what a person or a script
choosing a job to preempt reads), and a deleted job's series go with it."""

from __future__ import annotations

from seqtrain.spec.status import JobStatus, WorkAtRisk
from seqtrain_operator.k8s.process.metrics import OperatorMetrics


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


def test_lost_time_restarts_and_progress_per_job_and_the_phase_counts():
    m = OperatorMetrics()
    st = JobStatus.model_validate({"phase": "Running", "goodput": 0.75, "productiveSeconds": 30.0, "restarts": 2,
                                   "infraRestarts": 1, "progress": {"step": 40, "totalSteps": 100},
                                   "lostSeconds": {"queueing": 4.5, "checkpointStall": 1.25}})
    m.job_status("team", "llm", st)
    m.job_phase("team", "llm", "Running")
    m.job_phase("team", "other", "Pending")
    m.job_phase("team", "third", "Running")
    get = m.registry.get_sample_value
    assert _value(m, "seqtrain_job_goodput_ratio") == 0.75
    assert _value(m, "seqtrain_job_step") == 40 and _value(m, "seqtrain_job_total_steps") == 100
    assert get("seqtrain_job_lost_seconds", {"namespace": "team", "job": "llm", "reason": "queueing"}) == 4.5
    assert get("seqtrain_job_lost_seconds", {"namespace": "team", "job": "llm", "reason": "checkpointStall"}) == 1.25
    assert get("seqtrain_job_restarts", {"namespace": "team", "job": "llm", "kind": "infrastructure"}) == 1
    assert get("seqtrain_jobs", {"phase": "Running"}) == 2 and get("seqtrain_jobs", {"phase": "Pending"}) == 1
    m.job_phase("team", "third", "Succeeded")  # a job moves: one count down, one up
    m.job_phase("team", "other", None)  # deleted
    assert get("seqtrain_jobs", {"phase": "Running"}) == 1 and get("seqtrain_jobs", {"phase": "Pending"}) == 0
    assert get("seqtrain_jobs", {"phase": "Succeeded"}) == 1
    m.job_status("team", "llm", None)
    assert get("seqtrain_job_lost_seconds", {"namespace": "team", "job": "llm", "reason": "queueing"}) is None
    assert _value(m, "seqtrain_job_goodput_ratio") is None
