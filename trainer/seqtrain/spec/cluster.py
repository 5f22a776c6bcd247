"""Where and how the job runs: `spec.resources`, `spec.checkpoint`, `spec.faultTolerance`, `spec.scheduling`."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from seqtrain.spec.base import DAY, SpecModel

_INT_OR_STRING = {"x-kubernetes-int-or-string": True}
# resource.ParseQuantity's grammar, without a sign (requests are never negative): 2, 0.5, .5, 500m, 8Gi, 1e3.
_QUANTITY = re.compile(r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def _quantity(value: Any) -> str:
    # The CRD types quantities as int-or-string, as Kubernetes does: the apiserver refuses a YAML float
    # (`cpu: 0.5`) before anything else sees it, so `seqtrain validate` must refuse it too, with the fix.
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 2, \"0.5\", 500m, 8Gi)")
    if isinstance(value, float):
        raise ValueError(f"{value!r} is a number with a fraction; the API server accepts only an integer or a "
                         f"string here: write it quoted, e.g. \"{value}\"")
    text = str(value)
    if not _QUANTITY.match(text):
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 2, \"0.5\", 500m, 8Gi)")
    return text


_SUFFIX = {"m": Decimal("1e-3"), "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9),
           "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18), "Ki": Decimal(2**10),
           "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60)}
# Per replica: far beyond any node, small enough that every sum of them stays a sane number (`memory: 1e999`).
MAX_CPU = Decimal(100_000)
MAX_BYTES = Decimal(2**50)  # 1 PiB


def quantity_value(text: str) -> Decimal:
    """The number a quantity (already matched by _QUANTITY) stands for: `8Gi` -> 8589934592, `500m` -> 0.5."""
    m = _QUANTITY.match(text)
    assert m is not None, text
    number, suffix = text[:m.start(3)] if m.group(3) else text, m.group(3) or ""
    if suffix[:1] in ("e", "E") and suffix not in _SUFFIX:
        return Decimal(text.lstrip("+"))
    return Decimal(number.lstrip("+")) * _SUFFIX.get(suffix, Decimal(1))


def _bounded(text: str, cap: Decimal, what: str) -> str:
    if quantity_value(text) > cap:
        raise ValueError(f"{text!r} is more than any replica can have (at most {what})")
    return text


class ResourcesSpec(SpecModel):
    gpus: int = Field(0, ge=0, le=64, description="GPUs per replica (0 = CPU fallback).")
    processes_per_replica: int | None = Field(
        None, ge=1, le=256, description="Rank processes per replica; default: gpus, or 1 on CPU."
    )
    cpu: str = Field("1", description="CPU request per replica (Kubernetes quantity).", json_schema_extra=_INT_OR_STRING)
    memory: str = Field("4Gi", description="Memory request per replica (Kubernetes quantity).", json_schema_extra=_INT_OR_STRING)
    shm_size: str = Field("1Gi", description="Size of the in-memory /dev/shm volume.", json_schema_extra=_INT_OR_STRING)
    ephemeral_storage: str | None = Field(
        None, description="Ephemeral-storage request per replica (Kubernetes quantity): node-local disk for /tmp "
        "(compile caches) and logs; the native placement counts it like the scheduler does.",
        json_schema_extra=_INT_OR_STRING)
    gpu_product: str | None = Field(
        None, description="Required GPU model (label nvidia.com/gpu.product), e.g. NVIDIA-H100-80GB-HBM3."
    )
    peak_tflops: float | None = Field(
        None, gt=0, le=1e6, description="Peak dense TFLOP/s of one device at the job's precision, for MFU; default: the "
        "built-in table of known GPUs (seqtrain.obs.peaks). On CPU MFU stays empty unless this is set."
    )

    @field_validator("cpu", mode="before")
    @classmethod
    def _cpu(cls, value: Any) -> str:
        return _bounded(_quantity(value), MAX_CPU, f"{MAX_CPU} CPUs")

    @field_validator("memory", "shm_size", mode="before")
    @classmethod
    def _quantities(cls, value: Any) -> str:
        return _bounded(_quantity(value), MAX_BYTES, "1Pi")

    @field_validator("ephemeral_storage", mode="before")
    @classmethod
    def _optional_quantity(cls, value: Any) -> str | None:
        return None if value is None else _bounded(_quantity(value), MAX_BYTES, "1Pi")

    @property
    def procs(self) -> int:
        if self.processes_per_replica is not None:
            return self.processes_per_replica
        return self.gpus if self.gpus > 0 else 1


DEFAULT_INTERVAL_STEPS = 50


class CheckpointSpec(SpecModel):
    interval_steps: int | Literal["auto"] | None = Field(
        None, json_schema_extra=_INT_OR_STRING,
        description=f"Save a checkpoint every N optimizer steps (and at the end); `auto`: the interval follows "
        f"Young/Daly from the measured save cost, step time and the gang's MTBF, within minIntervalSteps.."
        f"maxIntervalSteps (status.checkpointPolicy shows the inputs). Default {DEFAULT_INTERVAL_STEPS}, unless "
        "intervalSeconds is set.")
    interval_seconds: float | None = Field(
        None, gt=0, le=30 * DAY, description="Save a checkpoint every this many seconds of training instead of every "
        "N steps (rank 0's clock decides, every rank saves the same step); excludes intervalSteps.")
    min_interval_steps: int = Field(1, ge=1, le=10**9, description="intervalSteps: auto never saves more often than "
                                    "every N steps.")
    max_interval_steps: int | None = Field(
        None, ge=1, le=10**9, description="intervalSteps: auto never saves less often than every N steps "
        "(default: no bound but the end of training).")
    keep: int = Field(3, ge=1, le=10_000, description="How many of the latest checkpoints to keep.")
    path: str | None = Field(
        None, description="Checkpoint folder on storage every rank shares (a local path, not a URI); "
        "default: <workdir>/checkpoints."
    )
    pvc: str | None = Field(None, description="Kubernetes: PersistentVolumeClaim mounted at /checkpoints.")
    save_on_sigterm: bool = Field(True, description="Save a checkpoint when the trainer receives SIGTERM.")
    async_save: bool = Field(
        True, description="Stage each save in host memory and write it in the background while training goes on "
        "(published atomically once every rank's write is complete; the next save waits for it). Every engine "
        "saves this way (all write the DCP format); false saves synchronously."
    )

    @field_validator("interval_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: Any) -> Any:
        # an int, or the one word `auto`; bounds by hand: `ge` does not apply to a union with a string
        if isinstance(value, str) and value.strip() != "auto":
            raise ValueError(f"{value!r} is neither a number of steps nor 'auto'; write e.g. 50 or auto")
        if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= 10**9:
            raise ValueError(f"{value} must be between 1 and 1000000000 steps (or auto)")
        return value.strip() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_interval(self) -> CheckpointSpec:
        if self.interval_seconds is not None and self.interval_steps is not None:
            raise ValueError(f"intervalSteps ({self.interval_steps}) and intervalSeconds ({self.interval_seconds:g}) "
                             "both set: keep one of them")
        if self.max_interval_steps is not None and self.max_interval_steps < self.min_interval_steps:
            raise ValueError(f"maxIntervalSteps ({self.max_interval_steps}) is below minIntervalSteps "
                             f"({self.min_interval_steps}): raise maxIntervalSteps or lower minIntervalSteps")
        return self

    @property
    def fixed_steps(self) -> int | None:
        """The user's fixed interval in steps; None for auto or intervalSeconds."""
        if self.interval_steps is None:
            return None if self.interval_seconds is not None else DEFAULT_INTERVAL_STEPS
        return None if self.interval_steps == "auto" else int(self.interval_steps)

    @field_validator("path")
    @classmethod
    def _no_escape(cls, path: str | None) -> str | None:
        # The trainer writes, prunes and quarantines folders under this path: `..` would aim that at whatever
        # lies above the workdir (`../../etc`).
        if path is not None and (".." in path.replace("\\", "/").split("/") or "\0" in path or not path.strip()):
            raise ValueError(f"{path!r} must name a folder without '..' parts, e.g. /checkpoints/{{job}} or "
                             "a path below the workdir")
        return path


class FaultToleranceSpec(SpecModel):
    max_restarts: int = Field(3, ge=0, le=10_000, description="Gang restarts allowed for failures of the training itself.")
    max_infra_restarts: int = Field(
        20, ge=0, le=10_000, description="Gang restarts allowed for infrastructure failures (eviction, preemption, node loss)."
    )
    backoff_seconds: float = Field(5.0, ge=0, le=DAY, description="Delay before the first restart; doubles each time.")
    max_backoff_seconds: float = Field(300.0, ge=0, le=DAY, description="Upper bound of the restart delay.")
    in_place_restarts: int = Field(
        2, ge=0, le=10_000, description="Of the restarts for failures of the training itself, how many may restart "
        "the ranks in the existing pods (each pod's launcher restarts them from the latest checkpoint; the pods, their "
        "nodes and images stay) before the gang is deleted and re-created. Counted in maxRestarts. 0: always "
        "re-create the gang."
    )
    hang_timeout_seconds: int | None = Field(
        None, ge=1, le=30 * DAY, description="Treat the gang as failed when no step completes for this long."
    )
    node_avoid_seconds: int = Field(600, ge=0, le=30 * DAY, description="Avoid a node that failed for this long.")
    image_pull_timeout_seconds: int = Field(
        900, ge=1, le=DAY, description="How long replicas may keep failing to pull the image (ErrImagePull, "
        "ImagePullBackOff: often a registry hiccup on a large image) before the job fails; counted from the gang's "
        "creation, and it replaces scheduling.pendingGraceSeconds while a pull is failing."
    )


class Toleration(SpecModel):
    """A Kubernetes pod toleration (same fields and meaning as core/v1 Toleration)."""

    key: str | None = Field(None, description="Taint key to tolerate; unset with operator Exists tolerates every taint.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Equal: key and value must match; Exists: key only.")
    value: str | None = Field(None, description="Taint value to match (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; unset matches all effects."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, le=365 * DAY, description="NoExecute only: how long the pod stays bound after the taint appears."
    )


class TopologySpec(SpecModel):
    policy: Literal["none", "pack", "require", "spread"] = Field(
        "pack", description="pack: fewest domains; require: one domain only; spread: as many domains as possible."
    )
    keys: list[str] = Field(
        default_factory=lambda: ["topology.kubernetes.io/zone"],
        description="Node label keys that define topology domains, outermost first.",
    )
    name: str | None = Field(
        None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description="gang kai: the cluster's Topology object (kueue.x-k8s.io Topology, which KAI reads) that the "
        "PodGroup's topologyConstraint names; Kueue takes it from the ResourceFlavor instead.",
    )


class SchedulingSpec(SpecModel):
    gang: Literal["native", "coscheduling", "volcano", "kueue", "kai"] = Field(
        "native", description="Gang scheduler: native (seqtrain places the gang itself) or an external one."
    )
    queue: str | None = Field(None, description="Queue (Volcano queue, Kueue LocalQueue, KAI queue).")
    priority_class_name: str | None = Field(None, description="PriorityClass of the trainer pods.")
    topology: TopologySpec = Field(default_factory=TopologySpec, description="GPU topology placement policy.")
    timeout_seconds: int | None = Field(None, ge=1, le=365 * DAY, description="How long the gang may wait for capacity.")
    on_timeout: Literal["fail", "wait"] = Field("fail", description="What to do when timeoutSeconds passes.")
    pending_grace_seconds: int = Field(
        300, ge=1, le=30 * DAY, description="A created pod that kube-scheduler could not place (Unschedulable) for "
        "longer than this tears the gang down for re-planning. Pods already placed on a node and starting (pulling "
        "the image, attaching and mounting volumes) count toward startTimeoutSeconds instead."
    )
    start_timeout_seconds: int = Field(
        1800, ge=1, le=30 * DAY, description="How long pods placed on a node may take to start (ContainerCreating: "
        "a 10-20 GB image pull, a volume attach) before the gang is torn down and re-planned; counted from the "
        "gang's creation. The reason shows in the Starting condition meanwhile."
    )
    autoscale: bool | None = Field(
        None, description="A native gang that does not fit today's nodes creates its pods anyway, not pinned to "
        "nodes, so a cluster autoscaler (Cluster Autoscaler, Karpenter, GKE node auto-provisioning) sees the whole "
        "gang's demand at once and adds nodes; kube-scheduler places the pods. All or nothing still holds: replicas "
        "not placed within autoscaleTimeoutSeconds tear the gang down and the job waits again. Unset: the "
        "operator's default (the chart's operator.autoscale, on where the cluster has an autoscaler); false: a gang "
        "that does not fit creates no pod (without an autoscaler, placed pods would hold capacity while the rest "
        "cannot run).")
    autoscale_timeout_seconds: int = Field(
        900, ge=30, le=DAY, description="With autoscale: how long the gang's unpinned pods may wait for the "
        "autoscaler's nodes (counted from the gang's creation) before the gang is torn down and re-planned. New GPU "
        "nodes take minutes: set it above your node pool's scale-up time.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels every trainer pod requires.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of the trainer pods.")
    do_not_disrupt: bool = Field(
        False, description="Annotate the trainer pods karpenter.sh/do-not-disrupt and cluster-autoscaler's "
        "safe-to-evict=false: autoscalers then never consolidate or scale down a node the gang runs on."
    )
    pod_disruption_budget: bool = Field(
        False, description="Create a PodDisruptionBudget (maxUnavailable 0) over the job's pods: a drain or any other "
        "eviction through the Eviction API waits for the job instead of restarting the whole gang."
    )
