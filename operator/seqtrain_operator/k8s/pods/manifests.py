"""Kubernetes objects of one gang incarnation, as plain dicts. Pure: no I/O, no clock, no randomness.

Per job: a headless Service (stable DNS for rendezvous, lives as long as the job). Per attempt: a ConfigMap with
the trainer config (the job's fields as the user set them: the trainer resolves the rest), one pod per replica, and for an external gang scheduler its PodGroup (or labels).
Every object carries an ownerReference to the SeqTrainJob, so deleting the job garbage-collects all of them, and
the labels `seqtrain.dev/job` / `seqtrain.dev/attempt` / `seqtrain.dev/replica` the operator selects them by.

Pods run `seqtrain train --config ...` (one rank) or `seqtrain train --config ... --nproc-per-node N` (several ranks
per pod: seqtrain.runtime.launch, which keeps the ranks' exit codes), always as an argv list: no user string ever
reaches a shell.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from seqtrain.runtime.launch import replica_command
from seqtrain.spec import API_VERSION, KIND, RuntimeConfig, SeqTrainJob, TrainerConfig
from seqtrain.spec.names import configmap_name, hostname, pod_name, service_name
from seqtrain.spec.policy import PodPolicy
from seqtrain.spec.replica_env import INPLACE_DELAYS_ENV, replica_env
from seqtrain.spec.runtime import FailureHistory
from seqtrain_operator.k8s.gangs import ADAPTERS, adapter_for
from seqtrain_operator.k8s.owner import LABEL_ATTEMPT, LABEL_JOB, LABEL_REPLICA, LABEL_UID, Owner
from seqtrain_operator.k8s.pods.hfinit import add_hf_init
from seqtrain_operator.k8s.pods.pushauth import (
    TOKEN_DIR,
    TOKEN_FILE,
    TOKEN_FILE_ENV,
    TOKEN_KEY,
    URL_ENV,
    job_token,
    push_url,
    secret_name,
)
from seqtrain_operator.k8s.pods.template import apply_pod_template
from seqtrain_operator.planner.inventory import GPU_PRODUCT_LABEL, GPU_RESOURCE
from seqtrain_operator.planner.placement import pod_tolerations
from seqtrain_operator.planner.types import Plan

LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGER = "seqtrain-operator"
CONTAINER = "trainer"
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
CONFIG_DIR = "/etc/seqtrain"
CONFIG_FILE = "config.json"
CHECKPOINT_MOUNT = "/checkpoints"

# The external gang schedulers, one module each under k8s/gangs/, as main.py reads them: the CRD that proves one is
# installed, its PodGroup API, its scheduler name.
EXTERNAL = MappingProxyType({
    name: MappingProxyType({"crd": a.crd, "api": a.podgroup_api, "plural": a.podgroup_plural if a.podgroup_api else None,
                            "scheduler": a.scheduler_name}) for name, a in ADAPTERS.items()})


@dataclass(frozen=True)
class Settings:
    """Operator-wide choices that are not part of a job's spec (Helm values / command-line options)."""

    master_port: int = 29500
    progress_port: int | None = 8471
    metrics_port: int | None = None
    termination_grace_seconds: int = 120
    run_as_user: int = 1000
    image_pull_policy: str = "IfNotPresent"
    scheduler_names: dict[str, str] = field(default_factory=dict)  # gang -> schedulerName override
    pod_policy: PodPolicy = field(default_factory=PodPolicy)  # what a job's pod template may ask (spec.policy)
    network_policy: bool = False  # one NetworkPolicy per job (build_network_policy)
    operator_namespace: str | None = None  # where the operator's pods run, and their labels: the progress poller
    operator_labels: dict[str, str] = field(default_factory=dict)
    rank_mtbf_hours: float | None = None  # cluster prior of checkpoint.intervalSteps: auto (None: the trainer's)
    autoscale: bool = False  # the cluster has a node autoscaler (controller.gang_policy.autoscales)
    # Kueue gangs: the work at risk as the Workload's priority boost (controller.checkpoint_policy.priority_boost);
    # seconds of work at risk per point (0: off) and the largest boost
    kueue_boost_seconds: float = 0.0
    kueue_boost_max: int = 50  # the command line's default too
    # The operator's progress push endpoint as pods reach it (e.g. http://<its Service>.<namespace>.svc:8472) and
    # the key of the jobs' push tokens (k8s/progress/push.py); either unset: pods do not push.
    progress_push_url: str | None = None
    push_key: bytes = field(default=b"", repr=False)

    def scheduler_for(self, gang: str) -> str | None:
        return self.scheduler_names.get(gang) or EXTERNAL.get(gang, {}).get("scheduler")


# ---- names (seqtrain.spec.names: spec validation checks every name a job will generate) ----------------------

def master_addr(owner: Owner) -> str:
    return f"{hostname(owner.name, 0)}.{service_name(owner.name)}.{owner.namespace}.svc"


def job_labels(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_MANAGED: MANAGER}


def attempt_labels(job: str, attempt: int) -> dict[str, str]:
    return {**job_labels(job), LABEL_ATTEMPT: str(attempt)}


def _meta(name: str, owner: Owner, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": owner.namespace, "labels": {**labels, LABEL_UID: owner.uid},
                            "ownerReferences": [owner.reference()]}
    if annotations:
        meta["annotations"] = annotations
    return meta


# ---- objects ---------------------------------------------------------------------------------------------------


def build_service(owner: Owner, settings: Settings) -> dict[str, Any]:
    """Headless Service: gives every pod `<job>-<replica>.<job>` DNS, including pods not ready yet (rendezvous
    happens before any readiness)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(service_name(owner.name), owner, job_labels(owner.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": job_labels(owner.name),
            "ports": [{"name": "rendezvous", "port": settings.master_port, "targetPort": settings.master_port,
                       "protocol": "TCP"}],
        },
    }


def build_network_policy(job: SeqTrainJob, owner: Owner, settings: Settings) -> dict[str, Any]:
    """Ingress to the job's pods: from the gang's own pods on any port (rendezvous on the master port, then gloo and
    NCCL connect on ports they pick themselves), from the operator's pods to the progress port, and from anywhere to
    the trainer metrics ports when those are on (Prometheus runs wherever the cluster keeps it). Nothing else: no
    other tenant can join the rendezvous or read progress."""
    ours = {"podSelector": {"matchLabels": job_labels(owner.name)}}
    rules: list[dict[str, Any]] = [{"from": [ours]}]
    if settings.progress_port:
        peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(settings.operator_labels)}}
        if settings.operator_namespace:
            peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": settings.operator_namespace}}
        rules.append({"from": [peer], "ports": [{"protocol": "TCP", "port": settings.progress_port}]})
    if settings.metrics_port:
        rules.append({"ports": [{"protocol": "TCP", "port": settings.metrics_port + r}
                                for r in range(job.spec.resources.procs)]})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(service_name(owner.name), owner, job_labels(owner.name)),
        "spec": {"podSelector": {"matchLabels": job_labels(owner.name)}, "policyTypes": ["Ingress"],
                 "ingress": rules},
    }


def build_pdb(owner: Owner) -> dict[str, Any]:
    """scheduling.podDisruptionBudget: no voluntary eviction of the job's pods (a drain, a scale-down) while they run:
    one evicted replica restarts the whole gang, so the eviction waits for the job instead."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(service_name(owner.name), owner, job_labels(owner.name)),
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {**job_labels(owner.name), LABEL_UID: owner.uid}}},
    }


def checkpoint_paths(job: SeqTrainJob) -> tuple[str, str]:
    """(workdir, checkpoint_dir) inside the pod. The workdir lives on the checkpoint volume so metrics.jsonl and
    progress.json survive a gang restart like the checkpoints do."""
    workdir = f"{CHECKPOINT_MOUNT}/{job.name}"
    ck = job.spec.checkpoint.path or f"{workdir}/checkpoints"
    return workdir, ck


def trainer_config(job: SeqTrainJob, attempt: int, settings: Settings,
                   history: FailureHistory | None = None) -> dict[str, Any]:
    workdir, ck = checkpoint_paths(job)
    runtime = RuntimeConfig(workdir=workdir, checkpoint_dir=ck, attempt=attempt,
                            progress_port=settings.progress_port, metrics_port=settings.metrics_port,
                            failure_history=history or FailureHistory(rank_mtbf_hours=settings.rank_mtbf_hours))
    return TrainerConfig(job=user_fields(job), runtime=runtime).to_dict()


def user_fields(job: SeqTrainJob) -> dict[str, Any]:
    """The job as its user wrote it: the fields they set, nothing derived. The trainer derives the rest (preset
    dims, vocabulary from the prepared data or tokenizer, shapes from model.init's weights) where the files are;
    the operator never reads a user's paths (`seqtrain.spec.resolve.paths_readable`)."""
    out = job.model_dump(by_alias=True, mode="json", exclude_unset=True, exclude={"status", "metadata"})
    return {"apiVersion": API_VERSION, "kind": KIND, **out,
            "metadata": {k: v for k, v in job.metadata.model_dump(mode="json").items() if v not in (None, {}, [])}}


def build_configmap(job: SeqTrainJob, owner: Owner, attempt: int, settings: Settings,
                    history: FailureHistory | None = None) -> dict[str, Any]:
    text = json.dumps(trainer_config(job, attempt, settings, history), indent=2, sort_keys=True)
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(configmap_name(owner.name, attempt), owner, attempt_labels(owner.name, attempt)),
        "immutable": True,  # one per attempt: what a gang started with never changes under it
        "data": {CONFIG_FILE: text},
    }


def _command(job: SeqTrainJob, owner: Owner, replica: int, settings: Settings) -> list[str]:
    # Several ranks per pod: our launcher (seqtrain.runtime.launch) gives them RANK = NODE_RANK*N + local rank from the
    # env below and exits with replica_exit_code of theirs (torchrun would turn an invalid config's 3 into 1). No
    # restarts of its own: the operator restarts the whole gang. The local backend runs the same command.
    return replica_command(f"{CONFIG_DIR}/{CONFIG_FILE}", job.spec.resources.procs)


def restart_port(settings: Settings) -> int:
    """The in-place restart coordinator's port on NODE_RANK 0's pod: the one after the rendezvous port."""
    return settings.master_port + 1


def _env(job: SeqTrainJob, owner: Owner, attempt: int, replica: int, settings: Settings,
         in_place_delays: tuple[float, ...] = ()) -> list[dict[str, Any]]:
    """The replica's environment: the one contract (seqtrain.spec.replica_env) with a pod's arguments, the pod's
    own identity from the downward API, and the progress push's address and token file."""
    contract = replica_env(replica=replica, attempt=attempt, world_size=job.spec.world_size,
                           procs=job.spec.resources.procs, master_addr=master_addr(owner),
                           master_port=settings.master_port, grace_period=settings.termination_grace_seconds,
                           job=owner.name, read_only_root=True, in_place_delays=in_place_delays,
                           restart_port=restart_port(settings) if in_place_delays else None,
                           compile_cache_dir=compile_cache_dir(job))
    env: list[dict[str, Any]] = []
    for name, value in contract.items():
        if name == INPLACE_DELAYS_ENV and _pushes(settings):
            env += _push_env(owner, attempt, settings)
        env.append({"name": name, "value": value})
        if name == "SEQTRAIN_REPLICA":
            env += [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}} for var, path in _DOWNWARD]
    if _pushes(settings) and INPLACE_DELAYS_ENV not in contract:
        env += _push_env(owner, attempt, settings)
    return env


# The pod's own name, address and node, as the kubelet fills them in.
_DOWNWARD = (("POD_NAME", "metadata.name"), ("POD_IP", "status.podIP"), ("NODE_NAME", "spec.nodeName"))


def _push_env(owner: Owner, attempt: int, settings: Settings) -> list[dict[str, Any]]:
    """Rank 0 pushes its progress (k8s/progress/push.py); the token is a file, never in the env."""
    return [{"name": URL_ENV,
             "value": push_url(settings.progress_push_url or "", owner.namespace, owner.name, owner.uid, attempt)},
            {"name": TOKEN_FILE_ENV, "value": TOKEN_FILE}]


def _pushes(settings: Settings) -> bool:
    return bool(settings.progress_push_url and settings.push_key)


PUSH_VOLUME = "seqtrain-push-token"


def build_push_secret(owner: Owner, attempt: int, settings: Settings) -> dict[str, Any] | None:
    """The attempt's push token (k8s/pods/pushauth.py) as a Secret owned by the job (None: pods do not push).
    Mounted as a file, so `get pods` (the built-in view role) does not show it."""
    if not _pushes(settings):
        return None
    token = job_token(settings.push_key, owner.namespace, owner.name, owner.uid, attempt)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": _meta(secret_name(owner.name, owner.uid, attempt), owner, attempt_labels(owner.name, attempt)),
            "stringData": {TOKEN_KEY: token}}


def _resources(job: SeqTrainJob) -> dict[str, Any]:
    r = job.spec.resources
    requests: dict[str, Any] = {"cpu": r.cpu, "memory": r.memory}
    limits: dict[str, Any] = {"memory": r.memory}
    if r.ephemeral_storage:
        requests["ephemeral-storage"] = r.ephemeral_storage
    if r.gpus:
        requests[GPU_RESOURCE] = str(r.gpus)
        limits[GPU_RESOURCE] = str(r.gpus)
    return {"requests": requests, "limits": limits}


def compile_cache_dir(job: SeqTrainJob) -> str | None:
    """A GPU job's torch.compile/Triton caches on its checkpoint claim (beside its checkpoints), so the pods of its
    next attempt start with the kernels compiled; None (the pod's /tmp) without a claim or a GPU."""
    if not job.spec.checkpoint.pvc or job.spec.resources.gpus <= 0:
        return None
    return f"{checkpoint_paths(job)[0]}/.compile-cache"


def _volumes(job: SeqTrainJob, owner: Owner, attempt: int) -> list[dict[str, Any]]:
    ck = job.spec.checkpoint
    storage: dict[str, Any] = ({"persistentVolumeClaim": {"claimName": ck.pvc}} if ck.pvc else {"emptyDir": {}})
    return [
        {"name": "config", "configMap": {"name": configmap_name(owner.name, attempt)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.spec.resources.shm_size}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "checkpoints", **storage},
    ]


def _affinity(node: str | None) -> dict[str, Any] | None:
    if node is None:
        return None
    # Pinned by the native gang placement; the scheduler and kubelet still admit the pod (resources, taints).
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}


def gang_metadata(job: SeqTrainJob, owner: Owner, attempt: int) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) an external gang scheduler needs on every pod."""
    adapter = adapter_for(job.spec.scheduling.gang)
    return adapter.pod_metadata(job, owner, attempt) if adapter is not None else ({}, {})


def build_pod(job: SeqTrainJob, owner: Owner, attempt: int, replica: int, settings: Settings,
              node: str | None = None, in_place_delays: tuple[float, ...] = ()) -> dict[str, Any]:
    """One replica's pod. `node` pins it (native gang); None leaves placement to the (external) scheduler."""
    s = job.spec
    gang_labels, gang_annotations = gang_metadata(job, owner, attempt)
    labels = {**attempt_labels(owner.name, attempt), LABEL_REPLICA: str(replica), **gang_labels}
    ports = [{"name": "rendezvous", "containerPort": settings.master_port, "protocol": "TCP"}]
    if in_place_delays:  # NODE_RANK 0's launcher coordinates in-place restarts here (seqtrain.runtime.restart)
        ports.append({"name": "restart", "containerPort": restart_port(settings), "protocol": "TCP"})
    if settings.progress_port:
        ports.append({"name": "progress", "containerPort": settings.progress_port, "protocol": "TCP"})
    annotations = dict(gang_annotations)
    if s.scheduling.do_not_disrupt:  # Karpenter's and Cluster Autoscaler's words for "leave this node alone"
        annotations |= {DO_NOT_DISRUPT: "true", SAFE_TO_EVICT: "false"}
    if settings.metrics_port:
        # Rank r of the pod serves /metrics on metrics_port + r (seqtrain.obs.prometheus); the annotations let a
        # Prometheus with the usual pod-annotation scrape config find local rank 0 without a PodMonitor.
        for r in range(s.resources.procs):
            ports.append({"name": "metrics" if r == 0 else f"metrics-{r}", "containerPort": settings.metrics_port + r,
                          "protocol": "TCP"})
        annotations |= {"prometheus.io/scrape": "true", "prometheus.io/port": str(settings.metrics_port),
                        "prometheus.io/path": "/metrics"}
    container = {
        "name": CONTAINER,
        "image": s.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": _command(job, owner, replica, settings),
        "env": _env(job, owner, attempt, replica, settings, in_place_delays),
        "ports": ports,
        "resources": _resources(job),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT},
        ],
        # The trainer writes its final progress here; the operator reads it from the pod status after exit.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    node_selector = dict(s.scheduling.node_selector)
    if s.resources.gpu_product:
        node_selector[GPU_PRODUCT_LABEL] = s.resources.gpu_product
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a failed rank fails the pod; the operator restarts the whole gang
        "hostname": hostname(owner.name, replica),
        "subdomain": service_name(owner.name),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # trainers never talk to the API server
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "fsGroup": settings.run_as_user,
            # Re-chown the checkpoint volume only when its root does not match: a recursive chown of a large
            # checkpoint claim on every gang restart can take minutes.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": _volumes(job, owner, attempt),
    }
    if _pushes(settings):  # the push token (build_push_secret), read-only, only in the trainer container
        spec["volumes"].append({"name": PUSH_VOLUME, "secret": {
            "secretName": secret_name(owner.name, owner.uid, attempt), "defaultMode": 0o444}})
        container["volumeMounts"].append({"name": PUSH_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True})
    # model.init hf://: the init container fills /checkpoints/<job>/hf once; the ranks read it through SEQTRAIN_HF_DIR
    add_hf_init(spec, job, settings.image_pull_policy, CONTAINER, CHECKPOINT_MOUNT)
    if node_selector:
        spec["nodeSelector"] = node_selector
    if tolerations := pod_tolerations(job):  # the user's, and nvidia.com/gpu on GPU pods (ExtendedResourceToleration)
        spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]
    if s.scheduling.priority_class_name:
        spec["priorityClassName"] = s.scheduling.priority_class_name
    if (scheduler := settings.scheduler_for(s.scheduling.gang)) is not None:
        spec["schedulerName"] = scheduler
    if (affinity := _affinity(node)) is not None:
        spec["affinity"] = affinity
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": _meta(pod_name(owner.name, attempt, replica), owner, labels, annotations or None),
        "spec": spec,
    }
    adapter = adapter_for(s.scheduling.gang)
    if adapter is not None and not adapter.pods_owned_by_job:
        del pod["metadata"]["ownerReferences"]  # see gangs/kai.py: the operator deletes these pods itself
    return apply_pod_template(pod, s.pod_template, CONTAINER)  # the user's overrides, owned fields kept


def build_podgroup(job: SeqTrainJob, owner: Owner, attempt: int) -> dict[str, Any] | None:
    """The PodGroup of an external gang scheduler with minMember = replicas (None: native, or Kueue's labels)."""
    adapter = adapter_for(job.spec.scheduling.gang)
    if adapter is None or adapter.podgroup_api is None:
        return None
    meta = _meta(adapter.group_name(job, owner, attempt), owner, attempt_labels(owner.name, attempt))
    return adapter.podgroup(job, owner, attempt, meta, _resources(job)["requests"])


@dataclass(frozen=True)
class Gang:
    """Every object of one incarnation, in creation order (config first: pods mount it)."""

    configmap: dict[str, Any]
    podgroup: dict[str, Any] | None
    pods: tuple[dict[str, Any], ...]
    push_secret: dict[str, Any] | None = None  # build_push_secret; pods mount it


def build_gang(job: SeqTrainJob, owner: Owner, attempt: int, settings: Settings, plan: Plan | None,
               in_place_delays: tuple[float, ...] = (), history: FailureHistory | None = None) -> Gang:
    """The objects of attempt `attempt`. `plan` pins replica r to plan.replicas[r].node (native gang);
    `in_place_delays`: CreateGang.in_place_delays (the launchers' in-place restarts); `history`: the job's failures so
    far, for the trainer's checkpoint interval (seqtrain_operator.controller.checkpoint_policy)."""
    nodes = {a.replica: a.node for a in plan.replicas} if plan is not None else {}
    pods = tuple(build_pod(job, owner, attempt, r, settings, nodes.get(r), in_place_delays)
                 for r in range(job.spec.replicas))
    return Gang(build_configmap(job, owner, attempt, settings, history), build_podgroup(job, owner, attempt), pods,
                build_push_secret(owner, attempt, settings))
