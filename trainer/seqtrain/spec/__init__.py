"""SeqTrainJob spec: typed models, validation, CRD generation. Torch-free (the operator image imports it)."""

from seqtrain.spec.job import API_GROUP, API_VERSION, KIND, PLURAL, JobSpec, Metadata, SeqTrainJob
from seqtrain.spec.load import apply_overrides, load_job, load_job_file, load_jobs, parse_job
from seqtrain.spec.problems import Problem, SpecError
from seqtrain.spec.resolve import resolve, resolved_model
from seqtrain.spec.runtime import RuntimeConfig, TrainerConfig, read_trainer_config, write_trainer_config
from seqtrain.spec.status import TERMINAL_PHASES, Condition, JobStatus

__all__ = [
    "API_GROUP", "API_VERSION", "KIND", "PLURAL", "JobSpec", "Metadata", "SeqTrainJob",
    "apply_overrides", "load_job", "load_job_file", "load_jobs", "parse_job", "Problem", "SpecError",
    "resolve", "resolved_model", "RuntimeConfig", "TrainerConfig", "read_trainer_config",
    "write_trainer_config", "TERMINAL_PHASES", "Condition", "JobStatus",
]
