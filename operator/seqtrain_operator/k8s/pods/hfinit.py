"""The init container that brings `model.init: hf://ORG/NAME[@REVISION]` onto the checkpoint volume, once per job.

It runs the trainer image's downloader (`python -m seqtrain.hub`, seqtrain.hub.download) before the trainer
container starts: the model lands in /checkpoints/<job>/hf/ORG--NAME/<revision> (inside the job's own folder, like
its checkpoints), complete with a marker written last, so a restarted gang's init container finds it and downloads
nothing. The trainer container gets SEQTRAIN_HF_DIR, which `seqtrain.spec.init_source.local_folder` reads: every
rank loads the model (and its tokenizer) from the volume.

The hub token comes from the Secret the user names (`model.hubTokenSecret`, key `token`), as HF_TOKEN in this
container only: the trainer container never sees it. The pod policy's Secret allowlist decides whether the job may
name that Secret (seqtrain.spec.policy).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from seqtrain.spec import SeqTrainJob
from seqtrain.spec.init_source import HF_DIR_ENV, HF_SCHEME

INIT_CONTAINER = "hf-download"
TOKEN_KEY = "token"  # the key of the user's Secret that holds the hub token
# The download itself is I/O: a small share of a node; the limit bounds what a misbehaving server could make it hold.
RESOURCES = MappingProxyType({"requests": MappingProxyType({"cpu": "500m", "memory": "512Mi"}),
                              "limits": MappingProxyType({"memory": "2Gi"})})


def hf_root(job: SeqTrainJob, checkpoint_mount: str = "/checkpoints") -> str:
    return f"{checkpoint_mount}/{job.name}/hf"


def hf_uri(job: SeqTrainJob) -> str | None:
    init = job.spec.model.init
    return init if init and init.startswith(HF_SCHEME) else None


def token_secret(job: SeqTrainJob) -> str | None:
    """The Secret holding the hub token that the job names (model.hubTokenSecret), if any."""
    return getattr(job.spec.model, "hub_token_secret", None)


def hf_init_container(job: SeqTrainJob, image_pull_policy: str, checkpoint_mount: str = "/checkpoints",
                      endpoint: str | None = None, secret: str | None = None) -> dict[str, Any] | None:
    """The init container of a job whose model.init is hf://, or None. `endpoint`: the hub (HF_ENDPOINT, e.g. a
    mirror inside the cluster's network); default huggingface.co. `secret`: default the job's token_secret."""
    uri = hf_uri(job)
    if uri is None:
        return None
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}]
    if endpoint:
        env.append({"name": "HF_ENDPOINT", "value": endpoint})
    secret = secret or token_secret(job)
    if secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}})
    return {
        "name": INIT_CONTAINER,
        "image": job.spec.image,
        "imagePullPolicy": image_pull_policy,
        # an argv list: the URI is the user's string and never reaches a shell
        "command": ["python", "-m", "seqtrain.hub", uri, "--root", hf_root(job, checkpoint_mount)],
        "env": env,
        "resources": {k: dict(v) for k, v in RESOURCES.items()},  # a manifest of plain dicts
        "volumeMounts": [{"name": "checkpoints", "mountPath": checkpoint_mount},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
    }


def hf_trainer_env(job: SeqTrainJob, checkpoint_mount: str = "/checkpoints") -> list[dict[str, Any]]:
    """What the trainer container needs to read the download: where it is (nothing for other jobs)."""
    return [{"name": HF_DIR_ENV, "value": hf_root(job, checkpoint_mount)}] if hf_uri(job) else []


def add_hf_init(pod_spec: dict[str, Any], job: SeqTrainJob, image_pull_policy: str, trainer: str = "trainer",
                checkpoint_mount: str = "/checkpoints", endpoint: str | None = None, secret: str | None = None) -> None:
    """Put the init container first in `pod_spec` and SEQTRAIN_HF_DIR into the trainer container (no-op for a job
    whose model.init is not hf://). Before the user's pod template is applied: its init containers run after."""
    init = hf_init_container(job, image_pull_policy, checkpoint_mount, endpoint, secret)
    if init is None:
        return
    pod_spec["initContainers"] = [init, *pod_spec.get("initContainers", [])]
    for c in pod_spec.get("containers", []):
        if c.get("name") == trainer:
            c.setdefault("env", []).extend(hf_trainer_env(job, checkpoint_mount))
