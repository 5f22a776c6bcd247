"""What one rank process is given besides the job: where to write, which incarnation of the gang it is.

Written by the controller (local backend: a file; Kubernetes: a ConfigMap) and read by `seqtrain train --config`.
Rank identity (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) comes from the environment, as in a pod.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from seqtrain.spec.base import SpecModel
from seqtrain.spec.job import SeqTrainJob


class FailureHistory(SpecModel):
    """What the controller knows about the job's failures when it starts an attempt: the MTBF input of
    `checkpoint.intervalSteps: auto` (seqtrain.train.interval)."""

    failures: int = Field(0, ge=0, description="Gang restarts so far (status.restarts + status.infraRestarts).")
    running_seconds: float = Field(0.0, ge=0, description="Time the gang ran in earlier attempts "
                                   "(status.runningSeconds).")
    rank_mtbf_hours: float | None = Field(
        None, gt=0, description="Cluster prior: mean time between failures of one rank (GPU) in hours, from the "
        "operator's settings (chart: checkpointPolicy.rankMtbfHours); None: the trainer's default.")


class RuntimeConfig(SpecModel):
    workdir: str = Field(description="Run folder: metrics.jsonl, status-related files, logs.")
    checkpoint_dir: str = Field(description="Where checkpoints/step-N folders live.")
    attempt: int = Field(1, ge=1, description="Gang incarnation: 1 for the first start, +1 per restart.")
    progress_port: int | None = Field(
        None, ge=0, description="Rank 0 serves progress JSON on this port (None: off; 0: any free port, noted in "
        "<workdir>/endpoints/rank-0.json)."
    )
    metrics_port: int | None = Field(
        None, ge=0, description="Each rank serves Prometheus /metrics on this port + local rank (None: off; 0: any "
        "free port, noted in <workdir>/endpoints/rank-<R>.json)."
    )
    failure_history: FailureHistory = Field(default_factory=FailureHistory,
                                            description="The job's failures so far (checkpoint.intervalSteps: auto).")


class TrainerConfig(SpecModel):
    job: dict[str, Any] = Field(description="The resolved SeqTrainJob (wire form).")
    runtime: RuntimeConfig

    def load_job(self) -> SeqTrainJob:
        return SeqTrainJob.model_validate(self.job)


def write_trainer_config(path: str, job: SeqTrainJob, runtime: RuntimeConfig) -> None:
    cfg = TrainerConfig(job=job.to_dict(), runtime=runtime)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f, indent=2)


def read_trainer_config(path: str) -> TrainerConfig:
    with open(path, encoding="utf-8") as f:
        return TrainerConfig.model_validate(json.load(f))
