"""The pod policy: what a SeqTrainJob's pod template and scheduling fields may ask of a node. Pure, one module.

The operator's ServiceAccount creates the trainer pods, so whatever a job's `spec.podTemplate` and
`spec.scheduling` put into them is created with the operator's rights, not the user's. This module holds them to
a level the cluster admin chooses in the chart (`podPolicy.level`), modelled on the Kubernetes Pod Security
Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/):

- `privileged`: nothing beyond the operator's own fields (spec.template) is checked;
- `baseline` (default): no known privilege escalation: no privileged or hostProcess containers, no host
  namespaces, hostPath volumes (container runtime sockets included) or hostPorts; capabilities only from the
  Pod Security Standards' baseline list or the admin's allowlist (`IPC_LOCK` for RDMA must be allowlisted); no
  Unconfined seccomp or AppArmor, no custom SELinux user/role/type, no unmasked /proc, only namespaced-safe sysctls;
  no mount propagation but None, no legacy seccomp/AppArmor annotations; plus what the operator's own rights would
  otherwise grant: only allowlisted ServiceAccounts, and a ServiceAccount token (automounted or a projected
  `serviceAccountToken` source) only for one of them; Secrets (volumes, projected sources, `envFrom`, `secretKeyRef`,
  a volume's `secretRef`) only from the Secret allowlist when the admin set one; `checkpoint.path` only inside the
  job's own folder `/checkpoints/<job>` (the claim may be shared with other jobs); no toleration of every taint or
  of control-plane taints, no node selection of control-plane nodes, no `system-*` priority class unless
  allowlisted (with a priority-class allowlist, only those);
- `restricted`: baseline, and current pod hardening: volumes only of the restricted kinds (configMap, csi,
  downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, secret); every sidecar and init container
  sets `allowPrivilegeEscalation: false`, drops ALL capabilities and adds at most NET_BIND_SERVICE (or the
  allowlist); nothing runs as root (runAsUser 0, runAsNonRoot false); no Secret at all unless allowlisted.

Credentials follow one rule (`_credentials` lists every way a pod reaches one, `_credential_problems` decides): a
ServiceAccount's API rights and token need `podPolicy.serviceAccounts`, a Secret needs `podPolicy.secrets` (at
baseline an empty list allows any Secret of the namespace, as creating a Pod does in Kubernetes; at restricted an
empty list allows none).

`pod_spec_problems` checks a core/v1 PodSpec-shaped dict (every container, init container, ephemeral container
and volume); `job_policy_problems` builds that view of a job's spec and names each problem by the SeqTrainJob
field the user wrote. `seqtrain validate`, the admission webhook and the operator's reconcile all call it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from seqtrain.spec.problems import Problem

Level = Literal["restricted", "baseline", "privileged"]
LEVELS: tuple[str, ...] = ("restricted", "baseline", "privileged")
DEFAULT_LEVEL: Level = "baseline"

# Pod Security Standards, baseline: capabilities a container may add.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
    "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# Pod Security Standards, baseline: the "safe" (namespaced, resource-bounded) sysctls.
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
RESTRICTED_VOLUMES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"})
# Node labels and taints that mark control-plane nodes (kubeadm's, current and legacy).
CONTROL_PLANE_KEYS = frozenset({"node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master"})
RUNTIME_SOCKETS = ("docker.sock", "containerd.sock", "crio.sock", "cri-dockerd.sock", "kubelet")
# Annotations the kubelet read before securityContext had the fields (ignored or refused by current Kubernetes,
# honoured by older nodes): a profile is set with securityContext.seccompProfile / appArmorProfile instead.
LEGACY_PROFILE_ANNOTATIONS = ("seccomp.security.alpha.kubernetes.io/", "container.seccomp.security.alpha.kubernetes.io/",
                              "container.apparmor.security.beta.kubernetes.io/")
# The folder of job <name> on the checkpoint volume (manifests.checkpoint_paths): what checkpoint.path may name.
CHECKPOINT_ROOT = "/checkpoints"
ANY = "*"  # in an allowlist of Secrets: every Secret of the job's namespace


@dataclass(frozen=True)
class PodPolicy:
    """The admin's choice (chart value `podPolicy`; `seqtrain validate --policy`)."""

    level: Level = DEFAULT_LEVEL
    service_accounts: frozenset[str] = field(default_factory=frozenset)
    priority_classes: frozenset[str] = field(default_factory=frozenset)
    capabilities: frozenset[str] = field(default_factory=frozenset)
    secrets: frozenset[str] = field(default_factory=frozenset)  # Secret names ("*": any); empty: see the module doc

    @classmethod
    def of(cls, level: str = DEFAULT_LEVEL, service_accounts: Iterable[str] = (),
           priority_classes: Iterable[str] = (), capabilities: Iterable[str] = (),
           secrets: Iterable[str] = ()) -> PodPolicy:
        if level not in LEVELS:
            raise ValueError(f"pod policy {level!r}: use one of {', '.join(LEVELS)}")
        return cls(level, frozenset(service_accounts), frozenset(priority_classes),  # type: ignore[arg-type]
                   frozenset(_cap(c) for c in capabilities), frozenset(secrets))

    def secret_allowed(self, name: str) -> bool:
        if self.secrets:
            return ANY in self.secrets or name in self.secrets
        return self.level != "restricted"


def _d(x: Any) -> dict[str, Any]:
    """`x` if it is a mapping, else {}: the view holds core/v1 objects as written, so any level may be any type."""
    return x if isinstance(x, dict) else {}


def _l(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def _cap(name: Any) -> str:
    return str(name).upper().removeprefix("CAP_")


Out = list[tuple[str, str]]


def _security_context(sc: Any, where: str, policy: PodPolicy, out: Out, pod_level: bool = False) -> None:
    if not isinstance(sc, dict):
        return
    if sc.get("privileged"):
        out.append((f"{where}.privileged", "privileged containers have every capability and device of the node: "
                                           "remove it"))
    if _d(sc.get("windowsOptions")).get("hostProcess"):
        out.append((f"{where}.windowsOptions.hostProcess", "host processes run on the node itself: remove it"))
    if sc.get("procMount") not in (None, "Default"):
        out.append((f"{where}.procMount", "an unmasked /proc exposes the node: remove it (Default)"))
    if _d(sc.get("seccompProfile")).get("type") == "Unconfined":
        out.append((f"{where}.seccompProfile.type", "Unconfined lifts the syscall filter: use RuntimeDefault"))
    if _d(sc.get("appArmorProfile")).get("type") == "Unconfined":
        out.append((f"{where}.appArmorProfile.type", "Unconfined lifts AppArmor: use RuntimeDefault"))
    se = _d(sc.get("seLinuxOptions"))
    for key in ("user", "role"):
        if se.get(key):
            out.append((f"{where}.seLinuxOptions.{key}", "a custom SELinux user or role is not allowed"))
    if not isinstance(se.get("type", ""), str) or se.get("type", "") not in SELINUX_TYPES:
        out.append((f"{where}.seLinuxOptions.type", f"{se.get('type')!r} is not allowed; use one of "
                    f"{', '.join(sorted(t for t in SELINUX_TYPES if t))}"))
    if pod_level:
        for i, s in enumerate(_l(sc.get("sysctls"))):
            name = _d(s).get("name")
            if not isinstance(name, str) or name not in SAFE_SYSCTLS:
                out.append((f"{where}.sysctls[{i}].name", f"{name!r} is not a namespaced, safe sysctl"))
    if policy.level == "restricted":
        if sc.get("runAsNonRoot") is False:
            out.append((f"{where}.runAsNonRoot", "the restricted policy runs nothing as root: remove it"))
        if sc.get("runAsUser") == 0:
            out.append((f"{where}.runAsUser", "0 is root; the restricted policy runs nothing as root: use a UID "
                                              "above 0"))


def _capabilities(sc: Any, where: str, policy: PodPolicy, out: Out, require_drop: bool) -> None:
    caps = _d(_d(sc).get("capabilities"))
    allowed = (RESTRICTED_CAPABILITIES if policy.level == "restricted" else BASELINE_CAPABILITIES) | \
        policy.capabilities
    for i, cap in enumerate(_l(caps.get("add"))):
        if _cap(cap) not in allowed:
            what = "ALL is every capability, SYS_ADMIN included" if _cap(cap) == "ALL" else f"{cap}"
            out.append((f"{where}.capabilities.add[{i}]",
                        f"{what}: not allowed by the {policy.level} pod policy; the cluster admin can allowlist a "
                        f"capability (chart value podPolicy.capabilities, e.g. IPC_LOCK for RDMA)"))
    if require_drop:
        if "ALL" not in [str(c).upper() for c in _l(caps.get("drop"))]:
            out.append((f"{where}.capabilities.drop", "the restricted pod policy needs drop: [ALL]"))
        if _d(sc).get("allowPrivilegeEscalation") is not False:
            out.append((f"{where}.allowPrivilegeEscalation", "the restricted pod policy needs false"))


def _container(c: Any, where: str, policy: PodPolicy, out: Out, operator_hardened: bool) -> None:
    if not isinstance(c, dict):
        return
    sc = c.get("securityContext")
    _security_context(sc, f"{where}.securityContext", policy, out)
    # The trainer container's override: the operator already drops ALL and forbids escalation on it.
    _capabilities(sc, f"{where}.securityContext", policy, out,
                  require_drop=policy.level == "restricted" and not operator_hardened)
    for i, p in enumerate(_l(c.get("ports"))):
        if _d(p).get("hostPort"):
            out.append((f"{where}.ports[{i}].hostPort", "host ports bind the node's network: remove it"))
    for i, m in enumerate(_l(c.get("volumeMounts"))):
        if _d(m).get("mountPropagation") not in (None, "None"):
            out.append((f"{where}.volumeMounts[{i}].mountPropagation",
                        f"{_d(m).get('mountPropagation')!r} shares mounts with the node (Bidirectional lets the "
                        "container mount over the node's filesystem): remove it (None)"))


def _volume(v: Any, where: str, policy: PodPolicy, out: Out) -> None:
    if not isinstance(v, dict):
        return
    if "hostPath" in v:
        path = str(_d(v.get("hostPath")).get("path", ""))
        what = ("the container runtime's socket: whoever holds it is root on the node"
                if any(s in path for s in RUNTIME_SOCKETS) else "the node's own filesystem")
        out.append((f"{where}.hostPath", f"hostPath {path!r} mounts {what}; use a persistentVolumeClaim"))
    elif policy.level == "restricted":
        for k in v:
            if k == "name":
                continue
            if k not in RESTRICTED_VOLUMES:
                out.append((f"{where}.{k}", f"{k} volumes are not allowed by the restricted pod policy; use one of "
                                            f"{', '.join(sorted(RESTRICTED_VOLUMES))}"))


# ---- credentials: one list of every way to reach one, one rule for all -------------------------------------------
def _secret_refs_of_volume(v: dict[str, Any], where: str) -> Iterable[tuple[str, str, Any]]:
    for kind, source in v.items():
        src = _d(source)
        if kind == "secret":
            yield f"{where}.secret.secretName", "secret", src.get("secretName")
        elif kind == "projected":
            for j, s in enumerate(_l(src.get("sources"))):
                s = _d(s)
                if "secret" in s:
                    yield f"{where}.projected.sources[{j}].secret.name", "secret", _d(s["secret"]).get("name")
                if "serviceAccountToken" in s:
                    yield f"{where}.projected.sources[{j}].serviceAccountToken", "token", None
        elif kind != "name":
            # Volume plugins that log in with a Secret (csi's nodePublishSecretRef, cephfs/rbd/iscsi/flexVolume's
            # secretRef, azureFile's secretName): the plugin reads the Secret for the pod.
            for key in ("secretRef", "nodePublishSecretRef", "nodeStageSecretRef"):
                if key in src:
                    yield f"{where}.{kind}.{key}.name", "secret", _d(src[key]).get("name")
            if "secretName" in src:
                yield f"{where}.{kind}.secretName", "secret", src.get("secretName")


def _credentials(spec: dict[str, Any]) -> Iterable[tuple[str, str, Any]]:
    """(path in the PodSpec, kind, name) for every way the pod reaches a credential: kind "secret" (a Secret's
    name), "token" (the pod's ServiceAccount token) or "account" (the ServiceAccount's API rights)."""
    if spec.get("serviceAccountName"):
        yield "serviceAccountName", "account", spec.get("serviceAccountName")
    if spec.get("automountServiceAccountToken"):
        yield "automountServiceAccountToken", "token", None
    for i, s in enumerate(_l(spec.get("imagePullSecrets"))):
        yield f"imagePullSecrets[{i}].name", "secret", _d(s).get("name")
    for i, v in enumerate(_l(spec.get("volumes"))):
        yield from _secret_refs_of_volume(_d(v), f"volumes[{i}]")
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for i, c in enumerate(_l(spec.get(kind))):
            c = _d(c)
            for j, e in enumerate(_l(c.get("envFrom"))):
                if "secretRef" in _d(e):
                    yield f"{kind}[{i}].envFrom[{j}].secretRef.name", "secret", _d(_d(e)["secretRef"]).get("name")
            for j, e in enumerate(_l(c.get("env"))):
                ref = _d(_d(e).get("valueFrom"))
                if "secretKeyRef" in ref:
                    yield f"{kind}[{i}].env[{j}].valueFrom.secretKeyRef.name", "secret", \
                        _d(ref["secretKeyRef"]).get("name")


def _credential_problems(spec: dict[str, Any], policy: PodPolicy, out: Out) -> None:
    sa = spec.get("serviceAccountName")
    sa_ok = isinstance(sa, str) and sa in policy.service_accounts
    accounts = ", ".join(sorted(policy.service_accounts)) or "none"
    for path, kind, name in _credentials(spec):
        if kind == "account" and not sa_ok:
            out.append((path, f"{name!r} is not in the pod policy's allowlist ({accounts}); the cluster admin lists "
                              f"trainer ServiceAccounts in the chart value podPolicy.serviceAccounts"))
        elif kind == "token" and not sa_ok:
            out.append((path, "a ServiceAccount token is mounted only for an allowlisted serviceAccountName (the "
                              "namespace's default account is not one): remove it"))
        elif kind == "secret" and not (isinstance(name, str) and name and policy.secret_allowed(name)):
            listed = ", ".join(sorted(policy.secrets)) or "none"
            out.append((path, f"Secret {name!r} is not in the pod policy's Secret allowlist ({listed}); the cluster "
                              f"admin lists the Secrets jobs may read in the chart value podPolicy.secrets"))


def _node_terms(affinity: Any) -> Iterable[tuple[str, dict[str, Any]]]:
    na = _d(_d(affinity).get("nodeAffinity"))
    req = _d(na.get("requiredDuringSchedulingIgnoredDuringExecution"))
    for t, term in enumerate(_l(req.get("nodeSelectorTerms"))):
        yield f"affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{t}]", _d(term)
    for t, pref in enumerate(_l(na.get("preferredDuringSchedulingIgnoredDuringExecution"))):
        yield (f"affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[{t}].preference",
               _d(_d(pref).get("preference")))


def _placement(spec: dict[str, Any], policy: PodPolicy, out: Out) -> None:
    for key in _d(spec.get("nodeSelector")):
        if key in CONTROL_PLANE_KEYS:
            out.append((f"nodeSelector.{key}", "selects control-plane nodes: trainers run on worker nodes"))
    for where, term in _node_terms(spec.get("affinity")):
        for i, expr in enumerate(_l(term.get("matchExpressions"))):
            expr = _d(expr)
            if isinstance(expr.get("key"), str) and expr.get("key") in CONTROL_PLANE_KEYS and \
                    expr.get("operator") in ("In", "Exists"):
                out.append((f"{where}.matchExpressions[{i}].key",
                            "selects control-plane nodes: trainers run on worker nodes"))
    for i, t in enumerate(_l(spec.get("tolerations"))):
        if not isinstance(t, dict):
            continue
        if t.get("operator") == "Exists" and not t.get("key"):
            out.append((f"tolerations[{i}]", "operator Exists without a key tolerates every taint (control-plane, "
                                             "not-ready, dedicated nodes): name the taint's key"))
        elif isinstance(t.get("key"), str) and t.get("key") in CONTROL_PLANE_KEYS:
            out.append((f"tolerations[{i}].key", "tolerates the control-plane taint: trainers run on worker nodes"))


def _priority(spec: dict[str, Any], policy: PodPolicy, out: Out) -> None:
    pc = spec.get("priorityClassName")
    if pc and not isinstance(pc, str):
        out.append(("priorityClassName", f"must be a name, not {type(pc).__name__}"))
    elif pc and pc not in policy.priority_classes and (policy.priority_classes or str(pc).startswith("system-")):
        allowed = ", ".join(sorted(policy.priority_classes)) or "any but system-*"
        out.append(("priorityClassName", f"{pc!r} is not allowed by the pod policy ({allowed}); system-* classes "
                                         f"are for the cluster's own components and preempt everything"))


def pod_spec_problems(spec: dict[str, Any], policy: PodPolicy, hardened: frozenset[str] = frozenset(),
                      annotations: dict[str, str] | None = None) -> Out:
    """(path in the PodSpec, message) for everything `policy` refuses. `hardened`: container names the operator
    itself runs with drop ALL and no privilege escalation (their overrides may add capabilities only)."""
    if policy.level == "privileged":
        return []
    out: Out = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append((key, "shares the node's namespace: remove it"))
    _security_context(spec.get("securityContext"), "securityContext", policy, out, pod_level=True)
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for i, c in enumerate(_l(spec.get(kind))):
            name = _d(c).get("name")
            _container(c, f"{kind}[{i}]", policy, out,
                       operator_hardened=kind == "containers" and isinstance(name, str) and name in hardened)
    for i, v in enumerate(_l(spec.get("volumes"))):
        _volume(v, f"volumes[{i}]", policy, out)
    _placement(spec, policy, out)
    _credential_problems(spec, policy, out)
    _priority(spec, policy, out)
    for key in _d(annotations):
        if isinstance(key, str) and key.startswith(LEGACY_PROFILE_ANNOTATIONS):
            out.append((f"@annotations.{key}", "a legacy seccomp/AppArmor annotation (older kubelets honour it, "
                                               "unconfined included): set securityContext.seccompProfile or "
                                               "appArmorProfile instead"))
    return out


def checkpoint_path_problem(path: str | None, job: str) -> str | None:
    """Why `checkpoint.path` of job `job` leaves the job's own folder on the checkpoint volume (None: it does not).
    Jobs of a namespace may share one claim, each in /checkpoints/<job>; the trainer writes, prunes and sets
    checkpoints aside below checkpoint.path, so a path elsewhere would read or delete another job's."""
    if path is None:
        return None
    own = f"{CHECKPOINT_ROOT}/{job}"
    norm = posixpath.normpath(path) if path.startswith("/") else None
    if norm is not None and ".." not in path.split("/") and (norm == own or norm.startswith(own + "/")):
        return None
    return (f"{path!r} is outside the job's own folder {own}/ on the checkpoint volume (other jobs may share the "
            f"claim): use {own}/checkpoints or a folder below {own}/, or remove it (default {own}/checkpoints)")


# Where each PodSpec field of the view below comes from in a SeqTrainJob.
_FROM_SCHEDULING = {"nodeSelector": "spec.scheduling.nodeSelector", "tolerations": "spec.scheduling.tolerations",
                    "priorityClassName": "spec.scheduling.priorityClassName"}


def job_policy_problems(spec: Any, policy: PodPolicy, name: str | None = None) -> list[Problem]:
    """Problems of a JobSpec (seqtrain.spec.job.JobSpec) under `policy`, named by the SeqTrainJob field. `name`:
    the job's name, for the rule on checkpoint.path (not checked without it)."""
    from seqtrain.spec.template import TRAINER_CONTAINER

    t = spec.pod_template.spec
    view: dict[str, Any] = {
        "serviceAccountName": t.service_account_name,
        "automountServiceAccountToken": t.automount_service_account_token,
        "containers": t.containers, "initContainers": t.init_containers, "volumes": t.volumes,
        "affinity": t.affinity,
        "nodeSelector": spec.scheduling.node_selector,
        "tolerations": [x.model_dump(by_alias=True, exclude_none=True) for x in spec.scheduling.tolerations],
        "priorityClassName": spec.scheduling.priority_class_name,
    }
    # Fields a PodSpec has but the template model does not (ephemeralContainers, hostNetwork ...) are refused as
    # unknown by the model already; the model's extra fields, if ever added, are checked here as they are.
    view.update({k: v for k, v in (t.model_extra or {}).items() if k not in view})
    out = []
    for path, msg in pod_spec_problems(view, policy, hardened=frozenset({TRAINER_CONTAINER}),
                                       annotations=spec.pod_template.metadata.annotations):
        if path.startswith("@annotations."):
            full = "spec.podTemplate.metadata.annotations." + path.removeprefix("@annotations.")
        else:
            top = path.partition(".")[0].split("[")[0]
            full = (_FROM_SCHEDULING[top] + path[len(top):] if top in _FROM_SCHEDULING
                    else "spec.podTemplate.spec." + path)
        out.append(Problem(full, f"{msg} [pod policy {policy.level}]"))
    if name is not None and policy.level != "privileged" and \
            (why := checkpoint_path_problem(spec.checkpoint.path, name)) is not None:
        out.append(Problem("spec.checkpoint.path", f"{why} [pod policy {policy.level}]"))
    # The hf:// download's token Secret goes into the operator's own init container, which the template view above
    # does not hold: the same allowlist decides.
    hub = getattr(spec.model, "hub_token_secret", None)
    if hub and policy.level != "privileged" and not policy.secret_allowed(hub):
        out.append(Problem("spec.model.hubTokenSecret", f"Secret {hub!r} is not in the pod policy's Secret allowlist;"
                           f" list it in podPolicy.secrets [pod policy {policy.level}]"))
    return out
