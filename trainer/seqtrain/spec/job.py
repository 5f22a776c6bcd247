"""The SeqTrainJob custom resource: the one source of truth for the CRD, `seqtrain validate` and the trainer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from seqtrain.spec.base import SpecModel
from seqtrain.spec.cluster import CheckpointSpec, FaultToleranceSpec, ResourcesSpec, SchedulingSpec
from seqtrain.spec.data import DataSpec
from seqtrain.spec.model import ModelSpec
from seqtrain.spec.names import MAX_JOB_NAME, name_problems
from seqtrain.spec.optimization import OptimizationSpec
from seqtrain.spec.template import PodTemplate
from seqtrain.spec.training import TrainingSpec

API_GROUP = "seqtrain.dev"
API_VERSION_NAME = "v1alpha1"
API_VERSION = f"{API_GROUP}/{API_VERSION_NAME}"
KIND = "SeqTrainJob"
PLURAL = "seqtrainjobs"
SHORT_NAMES = ["stj"]
DEFAULT_IMAGE = "ghcr.io/seqtrain/trainer:0.1.0"
MAX_REPLICAS = 10_000  # pods in one gang: beyond the largest clusters, well below what would flood the API server
YEAR_SECONDS = 365 * 24 * 3600



class Metadata(BaseModel):
    # Kubernetes adds many fields (uid, resourceVersion, managedFields ...): accept and keep them.
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(description=f"Job name: a DNS-1035 label (lowercase letters, digits, '-', starting with a "
                                  f"letter: it names the job's Service), at most {MAX_JOB_NAME} characters.")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if problems := name_problems(name, 1):
            raise ValueError(problems[0])
        return name


class JobSpec(SpecModel):
    image: str = Field(DEFAULT_IMAGE, description="Trainer container image (Kubernetes only).")
    replicas: int = Field(1, ge=1, le=MAX_REPLICAS, description="Replicas (pods) in the gang; each runs resources.processesPerReplica ranks.")
    min_replicas: int | None = Field(
        None, ge=1, le=MAX_REPLICAS, description="Elastic gang: the fewest replicas an attempt may start with when the full gang "
        "does not fit (a lost node, short capacity); it grows back to `replicas` when capacity returns. The global "
        "batch stays the same (gradient accumulation makes up the difference) and the resume reshards the latest "
        "checkpoint. Unset: always `replicas`.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Per-replica resources.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="Model architecture and size.")
    data: DataSpec = Field(default_factory=DataSpec, description="Data source, tokenizer and batching.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Steps, batch, optimizer, schedule.")
    optimization: OptimizationSpec = Field(default_factory=OptimizationSpec, description="Precision, parallelism, memory.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoint cadence and storage.")
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec, description="Restarts and backoff.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Gang scheduling and placement.")
    suspend: bool = Field(False, description="true: checkpoint and remove the gang; false: resume it.")
    pod_template: PodTemplate = Field(
        default_factory=PodTemplate, description="Kubernetes: labels, annotations, env, volumes, sidecars, init "
        "containers, affinity, capabilities and extended resources merged over the generated trainer pods "
        "(the operator's own fields cannot be overridden).")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, le=YEAR_SECONDS, description="Kubernetes: delete the job (and with it every object it owns) this many seconds "
        "after it Succeeded or Failed; unset keeps it.")

    @property
    def world_size(self) -> int:
        return self.replicas * self.resources.procs

    @property
    def elastic(self) -> bool:
        """The gang may run with fewer than `replicas` (spec.minReplicas below it)."""
        return self.min_replicas is not None and self.min_replicas < self.replicas

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks left after tensor and pipeline parallel take theirs."""
        return max(1, self.world_size // (self.optimization.tensor_parallel * self.optimization.pipeline_parallel))

    @property
    def grad_accum(self) -> int:
        """Micro-batches each data-parallel rank accumulates per optimizer step."""
        return max(1, self.training.global_batch_size // (self.training.micro_batch_size * self.dp))


class SeqTrainJob(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: Literal["seqtrain.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["SeqTrainJob"] = KIND
    metadata: Metadata
    spec: JobSpec = Field(default_factory=JobSpec)
    # Present when read back from the cluster; validation ignores it.
    status: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.metadata.name

    @model_validator(mode="after")
    def _generated_names(self) -> SeqTrainJob:
        # Every object name the operator derives from this job (and its replica count) must be valid.
        if problems := name_problems(self.metadata.name, self.spec.replicas):
            raise ValueError("metadata.name: " + "; ".join(problems))
        return self

    def with_replicas(self, replicas: int) -> SeqTrainJob:
        """This job as one attempt of an elastic gang runs it: `replicas` replicas, the same global batch (the
        world size, data-parallel degree and accumulation derive from it). Not re-validated: `replicas` must be one
        of `seqtrain.spec.elastic.sizes(self)`."""
        if replicas == self.spec.replicas:
            return self
        spec = self.spec.model_copy(update={"replicas": replicas, "min_replicas": None})
        return self.model_copy(update={"spec": spec})

    def to_dict(self) -> dict:
        """Fully resolved wire form (defaults filled), without status."""
        out = self.model_dump(by_alias=True, mode="json", exclude={"status"})
        out["metadata"] = {k: v for k, v in out["metadata"].items() if v not in (None, {}, [])}
        return out
