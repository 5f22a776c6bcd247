"""`spec.podTemplate`: what a user adds to the pods the operator generates (secrets, volumes, sidecars, RDMA ...).

The shape follows Kubeflow Trainer's pod template overrides: `metadata` (labels, annotations) and a partial pod
`spec` whose `containers` entry named `trainer` is merged into the trainer container and whose other entries are
sidecars. Items (env vars, volumes, containers, affinity) are core/v1 objects kept as written; only the fields the
operator owns are checked here, so a bad override is refused by `seqtrain validate` and the webhook with the field
and the reason, never by a pod that fails to start.

Precedence (documented in docs/user-guide.md "Pod template overrides"):
1. fields the operator owns (rank and rendezvous env, ports, command, image, the config / shm / tmp / checkpoint
   volumes and their mounts, hostname, restartPolicy, schedulerName, gang labels): always the operator's; an
   override that touches them is refused;
2. the override: added to the pod (labels, annotations, env, envFrom, volumes, mounts, sidecars, init containers,
   capabilities, extended resources); an env var the operator only defaults (HOME, PYTHONUNBUFFERED, caches) is
   replaced; node affinity is ANDed with the operator's placement;
3. the operator's defaults.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from seqtrain.spec.base import SpecModel
from seqtrain.spec.names import (
    DNS1123_SUBDOMAIN,
    MAX_ANNOTATIONS_BYTES,
    MAX_SUBDOMAIN,
    annotations_size,
    dns1123_label_problem,
    env_var_name_problem,
    label_value_problem,
    qualified_name_problem,
)

TRAINER_CONTAINER = "trainer"
# Ports the trainer container listens on with the operator's defaults (--master-port, --progress-port); a sidecar
# shares the pod's network namespace, so it must not bind them.
OPERATOR_PORTS = {29500: "rendezvous (MASTER_PORT)", 8471: "progress"}
OWNED_VOLUMES = ("config", "dshm", "tmp", "checkpoints", "seqtrain-push-token")
OWNED_MOUNT_PATHS = ("/etc/seqtrain", "/dev/shm", "/tmp", "/checkpoints", "/var/run/seqtrain")
# Env vars that define the process group or the attempt: an override would silently break rendezvous or resume.
OWNED_ENV = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "ROLE_RANK", "POD_NAME", "POD_IP", "NODE_NAME",
})
OWNED_ENV_PREFIXES = ("SEQTRAIN_", "TORCHELASTIC_")
# ... except the fault-injection variables (seqtrain.runtime.faults): a user may run a fault drill on a cluster,
# and the trainer settings the user guide tells users to set in the trainer's environment (the operator never sets
# them): the checkpoint I/O deadline, the async writer's kind and the kernels switch.
DRILL_ENV_PREFIX = "SEQTRAIN_FAULT_"
USER_ENV = frozenset({"SEQTRAIN_CHECKPOINT_TIMEOUT_SECONDS", "SEQTRAIN_CHECKPOINT_WRITER", "SEQTRAIN_KERNELS"})
# Label / annotation prefixes the operator or the gang schedulers it drives own.
OWNED_META_PREFIXES = (
    "seqtrain.dev/", "app.kubernetes.io/managed-by", "kueue.x-k8s.io/", "scheduling.x-k8s.io/",
    "scheduling.k8s.io/group-name", "scheduling.volcano.sh/", "volcano.sh/", "kai.scheduler/", "pod-group-name",
    "prometheus.io/",
)
# The trainer container's own resources come from spec.resources; the override may add extended resources only.
OWNED_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage", "nvidia.com/gpu"})
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_TRAINER_FIELDS = ("env", "envFrom", "volumeMounts", "resources", "securityContext")
_OBJ = {"x-kubernetes-preserve-unknown-fields": True}


class PodTemplateMetadata(SpecModel):
    labels: dict[str, str] = Field(default_factory=dict, description="Labels added to every trainer pod.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations added to every trainer pod.")


class PodTemplateSpecOverride(SpecModel):
    service_account_name: str | None = Field(
        None, description="ServiceAccount of the trainer pods (e.g. for workload identity to cloud storage).")
    automount_service_account_token: bool | None = Field(
        None, description="Mount the ServiceAccount token into the pods; default false (trainers do not call the "
        "API server).")
    containers: list[dict[str, Any]] = Field(
        default_factory=list, json_schema_extra={"items": {"type": "object", **_OBJ}},
        description="core/v1 Containers. The entry named `trainer` is merged into the trainer container (only env, "
        "envFrom, volumeMounts, resources with extended resources such as rdma/ib, securityContext.capabilities."
        "add); every other entry is a sidecar added as written.")
    init_containers: list[dict[str, Any]] = Field(
        default_factory=list, json_schema_extra={"items": {"type": "object", **_OBJ}},
        description="core/v1 Containers run before the trainer (init containers).")
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, json_schema_extra={"items": {"type": "object", **_OBJ}},
        description="core/v1 Volumes added to the pod (secrets, config maps, datasets ...).")
    affinity: dict[str, Any] | None = Field(
        None, json_schema_extra=_OBJ,
        description="core/v1 Affinity. nodeAffinity is ANDed with the operator's placement (topology pin, GPU "
        "product); podAffinity and podAntiAffinity are added as written.")


class PodTemplate(SpecModel):
    metadata: PodTemplateMetadata = Field(default_factory=PodTemplateMetadata,
                                          description="Labels and annotations added to every trainer pod.")
    spec: PodTemplateSpecOverride = Field(default_factory=PodTemplateSpecOverride,
                                          description="Pod fields merged over the generated pod.")

    def trainer(self) -> dict[str, Any]:
        """The override of the trainer container ({} when none)."""
        return next((c for c in self.spec.containers if c.get("name") == TRAINER_CONTAINER), {})

    def extended_resources(self) -> dict[str, str]:
        """The extended resources (`rdma/ib`, `vpc.amazonaws.com/efa`: names with a `/`) the `trainer` entry adds to
        the trainer container, requests over limits (requested and limited at that quantity)."""
        res = self.trainer().get("resources") or {}
        return {name: str(qty) for name, qty in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items()
                if "/" in name}

    def sidecars(self) -> list[dict[str, Any]]:
        return [c for c in self.spec.containers if c.get("name") != TRAINER_CONTAINER]


def _owned_meta(key: str) -> bool:
    return any(key == p or key.startswith(p) for p in OWNED_META_PREFIXES)


def owned_env(name: str) -> bool:
    """An env var of the trainer container that only the operator sets."""
    if name in USER_ENV:
        return False
    return name in OWNED_ENV or (name.startswith(OWNED_ENV_PREFIXES) and not name.startswith(DRILL_ENV_PREFIX))


def _d(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _l(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def _typed(c: dict[str, Any], key: str, kind: type, where: str, out: list[tuple[str, str]]) -> Any:
    """c[key] if absent or of `kind`; else a problem naming it (core/v1 objects are kept as written, so a list where
    an object belongs would only fail when the pod is created)."""
    value = c.get(key)
    if value is not None and not isinstance(value, kind):
        out.append((f"{where}.{key}", f"must be {'a list' if kind is list else 'an object'}, not "
                                      f"{type(value).__name__}"))
        return kind()
    return value if value is not None else kind()


def _path_clash(path: str) -> str | None:
    p = path.rstrip("/") or "/"
    for owned in OWNED_MOUNT_PATHS:
        if p == owned or owned.startswith(p + "/") or p == "/" or p.startswith(owned + "/"):
            return owned
    return None


def _names(items: list[Any], where: str, out: list[tuple[str, str]]) -> list[str]:
    names = []
    for i, item in enumerate(items):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not name:
            out.append((f"{where}[{i}].name", "required"))
            continue
        names.append(name)
    for dup in sorted({n for n in names if names.count(n) > 1}):
        out.append((where, f"name {dup!r} appears more than once"))
    return names


def _container(c: dict[str, Any], where: str, out: list[tuple[str, str]], sidecar: bool) -> None:
    name = c.get("name")
    if isinstance(name, str) and name and (why := dns1123_label_problem(name)):
        out.append((f"{where}.name", why))
    if sidecar and not c.get("image"):
        out.append((f"{where}.image", "required for a sidecar or init container"))
    for i, e in enumerate(_typed(c, "env", list, where, out)):
        n = e.get("name") if isinstance(e, dict) else None
        if not n:
            out.append((f"{where}.env[{i}].name", "required"))
        elif why := env_var_name_problem(n):
            out.append((f"{where}.env[{i}].name", why))
        elif not sidecar and owned_env(n):
            out.append((f"{where}.env[{i}].name", f"{n} is set by the operator (rank and rendezvous): remove it"))
    for i, e in enumerate(_typed(c, "envFrom", list, where, out)):
        prefix = _d(e).get("prefix")
        if not isinstance(e, dict) or not any(k in e for k in ("configMapRef", "secretRef")):
            out.append((f"{where}.envFrom[{i}]", "needs configMapRef or secretRef"))
        elif prefix is not None and (why := env_var_name_problem(prefix)):
            out.append((f"{where}.envFrom[{i}].prefix", why))
    for i, m in enumerate(_typed(c, "volumeMounts", list, where, out)):
        path = m.get("mountPath") if isinstance(m, dict) else None
        if not isinstance(path, str) or not path or not isinstance(m.get("name"), str) or not m.get("name"):
            out.append((f"{where}.volumeMounts[{i}]", "needs name and mountPath"))
        elif not sidecar and (owned := _path_clash(path)):
            out.append((f"{where}.volumeMounts[{i}].mountPath",
                        f"{path} overlaps the operator's mount {owned}: mount somewhere else (e.g. /data)"))
        elif not sidecar and m.get("name") in OWNED_VOLUMES:
            out.append((f"{where}.volumeMounts[{i}].name", f"volume {m.get('name')!r} is the operator's"))
    for i, p in enumerate(_typed(c, "ports", list, where, out)):
        port = p.get("containerPort") if isinstance(p, dict) else None
        if isinstance(port, int) and port in OPERATOR_PORTS:
            out.append((f"{where}.ports[{i}].containerPort",
                        f"{port} is the trainer's {OPERATOR_PORTS[port]} port in the same pod: use another"))


def _trainer(c: dict[str, Any], where: str, out: list[tuple[str, str]]) -> None:
    for key in c:
        if key != "name" and key not in _TRAINER_FIELDS:
            hint = {"image": "set spec.image", "command": "the operator runs `seqtrain train`",
                    "args": "the operator runs `seqtrain train`", "ports": "the operator owns the trainer's ports"}
            out.append((f"{where}.{key}", f"cannot override the trainer's {key} "
                        f"({hint.get(key, 'allowed here: ' + ', '.join(_TRAINER_FIELDS))})"))
    _container(c, where, out, sidecar=False)
    res = _typed(c, "resources", dict, where, out)
    for part, values in res.items():
        if part not in ("requests", "limits") or not isinstance(values, dict):
            out.append((f"{where}.resources.{part}", "only requests and limits of extended resources"))
            continue
        for rname, qty in values.items():
            if rname in OWNED_RESOURCES:
                out.append((f"{where}.resources.{part}.{rname}",
                            "comes from spec.resources (cpu, memory, gpus): set it there"))
            elif "/" not in rname:
                out.append((f"{where}.resources.{part}.{rname}",
                            "only extended resources (vendor/name, e.g. rdma/ib) can be added"))
            elif not isinstance(qty, str | int) or isinstance(qty, bool) or len(str(qty)) > 64 \
                    or not _QUANTITY.match(str(qty)):
                out.append((f"{where}.resources.{part}.{rname}", f"{str(qty)[:64]!r} is not a Kubernetes quantity"))
    req, lim = _d(res.get("requests")), _d(res.get("limits"))
    for rname in set(req) & set(lim):
        if str(req[rname]) != str(lim[rname]):
            out.append((f"{where}.resources.limits.{rname}",
                        "extended resources cannot be overcommitted: requests and limits must be equal"))
    sc = _typed(c, "securityContext", dict, where, out)
    for key in sc:
        if key != "capabilities":
            out.append((f"{where}.securityContext.{key}",
                        "only capabilities.add can be changed (the operator runs the trainer non-root, read-only)"))
    caps = _d(sc.get("capabilities"))
    for key in caps:
        if key != "add":
            out.append((f"{where}.securityContext.capabilities.{key}", "only add (the operator drops ALL first)"))
    for i, cap in enumerate(_typed(caps, "add", list, f"{where}.securityContext.capabilities", out)):
        if not isinstance(cap, str) or not re.fullmatch(r"[A-Z_]+", cap.removeprefix("CAP_")):
            out.append((f"{where}.securityContext.capabilities.add[{i}]", f"{cap!r} is not a capability name"))
        elif cap.removeprefix("CAP_") in ("SYS_ADMIN", "ALL"):
            out.append((f"{where}.securityContext.capabilities.add[{i}]",
                        f"{cap} is not allowed{' (it includes SYS_ADMIN)' if cap == 'ALL' else ''}; IPC_LOCK is "
                        "what RDMA needs"))


def _metadata(t: PodTemplate, out: list[tuple[str, str]]) -> None:
    for kind in ("labels", "annotations"):
        for key, value in getattr(t.metadata, kind).items():
            if why := qualified_name_problem(key):
                out.append((f"metadata.{kind}.{key}", f"not a valid {kind[:-1]} key: {why}"))
            elif _owned_meta(key):
                why = ("set spec.scheduling.gang/queue instead" if not key.startswith(("seqtrain.dev/", "app."))
                       else "the operator selects its pods by it")
                out.append((f"metadata.{kind}.{key}", f"owned by the operator: {why}"))
            elif kind == "labels" and (why := label_value_problem(value)):
                out.append((f"metadata.labels.{key}", f"not a valid label value: {why}"))
    if (size := annotations_size(t.metadata.annotations)) > MAX_ANNOTATIONS_BYTES:
        out.append(("metadata.annotations", f"{size} bytes in all; Kubernetes allows at most "
                                            f"{MAX_ANNOTATIONS_BYTES} (256 KiB) of annotations on a pod: move data "
                                            "into a ConfigMap or a volume"))


_REQ, _PREF = "requiredDuringSchedulingIgnoredDuringExecution", "preferredDuringSchedulingIgnoredDuringExecution"


def _affinity(a: dict[str, Any], out: list[tuple[str, str]]) -> None:
    """The shapes the operator merges (k8s/pods/template.py ANDs node terms with its own placement): each level an
    object or a list of objects as core/v1 has it, so a merge never meets a string where a term belongs."""
    for key, value in a.items():
        where = f"spec.affinity.{key}"
        if key not in ("nodeAffinity", "podAffinity", "podAntiAffinity"):
            out.append((where, "unknown affinity kind"))
            continue
        if not isinstance(value, dict):
            out.append((where, f"must be an object, not {type(value).__name__}"))
            continue
        if key == "nodeAffinity":
            req = _typed(value, _REQ, dict, where, out)
            for i, term in enumerate(_typed(req, "nodeSelectorTerms", list, f"{where}.{_REQ}", out)):
                _term(term, f"{where}.{_REQ}.nodeSelectorTerms[{i}]", out)
            for i, pref in enumerate(_typed(value, _PREF, list, where, out)):
                if not isinstance(pref, dict):
                    out.append((f"{where}.{_PREF}[{i}]", "must be an object with weight and preference"))
                else:
                    _term(pref.get("preference") or {}, f"{where}.{_PREF}[{i}].preference", out)
        else:
            for rule in (_REQ, _PREF):
                for i, item in enumerate(_typed(value, rule, list, where, out)):
                    if not isinstance(item, dict):
                        out.append((f"{where}.{rule}[{i}]", f"must be an object, not {type(item).__name__}"))


def _term(term: Any, where: str, out: list[tuple[str, str]]) -> None:
    if not isinstance(term, dict):
        out.append((where, f"must be an object (a node selector term), not {type(term).__name__}"))
        return
    for key in ("matchExpressions", "matchFields"):
        for i, expr in enumerate(_typed(term, key, list, where, out)):
            if not isinstance(expr, dict):
                out.append((f"{where}.{key}[{i}]", "must be an object with key, operator and values"))


def template_problems(t: PodTemplate) -> list[tuple[str, str]]:
    """(path relative to spec.podTemplate, message) for every override of an operator-owned field and every name
    Kubernetes itself would refuse."""
    out: list[tuple[str, str]] = []
    _metadata(t, out)
    s = t.spec
    names = _names(s.containers, "spec.containers", out)
    init_names = _names(s.init_containers, "spec.initContainers", out)
    for n in sorted(set(names) & set(init_names)):
        out.append(("spec.initContainers", f"name {n!r} is also a container name"))
    for i, c in enumerate(s.containers):
        where = f"spec.containers[{i}]"
        if c.get("name") == TRAINER_CONTAINER:
            _trainer(c, where, out)
        else:
            _container(c, where, out, sidecar=True)
    for i, c in enumerate(s.init_containers):
        if c.get("name") == TRAINER_CONTAINER:
            out.append((f"spec.initContainers[{i}].name", "'trainer' is the trainer container's name"))
        _container(c, f"spec.initContainers[{i}]", out, sidecar=True)
    for i, name in enumerate(_names(s.volumes, "spec.volumes", out)):
        if name in OWNED_VOLUMES:
            out.append((f"spec.volumes[{i}].name", f"{name!r} is one of the operator's volumes "
                        f"({', '.join(OWNED_VOLUMES)}): rename it"))
        elif why := dns1123_label_problem(name):
            out.append((f"spec.volumes[{i}].name", why))
    declared = set(_names(s.volumes, "spec.volumes", []))
    for c in [*s.containers, *s.init_containers]:
        for m in _l(c.get("volumeMounts")):
            vol = m.get("name") if isinstance(m, dict) else None
            if isinstance(vol, str) and vol and vol not in declared and vol not in OWNED_VOLUMES:
                out.append((f"spec.containers[{c.get('name')}].volumeMounts",
                            f"mounts volume {vol!r}, which spec.podTemplate.spec.volumes does not declare"))
    if s.affinity is not None:
        _affinity(s.affinity, out)
    if s.service_account_name is not None and (len(s.service_account_name) > MAX_SUBDOMAIN or
                                               not DNS1123_SUBDOMAIN.match(s.service_account_name)):
        out.append(("spec.serviceAccountName", f"{s.service_account_name[:80]!r} is not a valid name (a DNS-1123 "
                                               "subdomain of at most 253 characters)"))
    return out
