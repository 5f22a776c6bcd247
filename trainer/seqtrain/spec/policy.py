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
  plus what the operator's own rights would otherwise grant: only allowlisted ServiceAccounts (and a token only for
  them), no toleration of every taint or of control-plane taints, no node selection of control-plane nodes, no
  `system-*` priority class unless allowlisted (with a priority-class allowlist, only those);
- `restricted`: baseline, and current pod hardening: volumes only of the restricted kinds (configMap, csi,
  downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, secret); every sidecar and init container
  sets `allowPrivilegeEscalation: false`, drops ALL capabilities and adds at most NET_BIND_SERVICE (or the
  allowlist); nothing runs as root (runAsUser 0, runAsNonRoot false).

`pod_spec_problems` checks a core/v1 PodSpec-shaped dict (every container, init container, ephemeral container
and volume); `job_policy_problems` builds that view of a job's spec and names each problem by the SeqTrainJob
field the user wrote. `seqtrain validate`, the admission webhook and the operator's reconcile all call it.
"""

from __future__ import annotations

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
_APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


@dataclass(frozen=True)
class PodPolicy:
    """The admin's choice (chart value `podPolicy`; `seqtrain validate --policy`)."""

    level: Level = DEFAULT_LEVEL
    service_accounts: frozenset[str] = field(default_factory=frozenset)
    priority_classes: frozenset[str] = field(default_factory=frozenset)
    capabilities: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, level: str = DEFAULT_LEVEL, service_accounts: Iterable[str] = (),
           priority_classes: Iterable[str] = (), capabilities: Iterable[str] = ()) -> PodPolicy:
        if level not in LEVELS:
            raise ValueError(f"pod policy {level!r}: use one of {', '.join(LEVELS)}")
        return cls(level, frozenset(service_accounts), frozenset(priority_classes),
                   frozenset(_cap(c) for c in capabilities))  # type: ignore[arg-type]


def _cap(name: Any) -> str:
    return str(name).upper().removeprefix("CAP_")


Out = list[tuple[str, str]]


def _security_context(sc: Any, where: str, policy: PodPolicy, out: Out, pod_level: bool = False) -> None:
    if not isinstance(sc, dict):
        return
    if sc.get("privileged"):
        out.append((f"{where}.privileged", "privileged containers have every capability and device of the node: "
                                           "remove it"))
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append((f"{where}.windowsOptions.hostProcess", "host processes run on the node itself: remove it"))
    if sc.get("procMount") not in (None, "Default"):
        out.append((f"{where}.procMount", "an unmasked /proc exposes the node: remove it (Default)"))
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append((f"{where}.seccompProfile.type", "Unconfined lifts the syscall filter: use RuntimeDefault"))
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append((f"{where}.appArmorProfile.type", "Unconfined lifts AppArmor: use RuntimeDefault"))
    se = sc.get("seLinuxOptions") or {}
    if isinstance(se, dict):
        for key in ("user", "role"):
            if se.get(key):
                out.append((f"{where}.seLinuxOptions.{key}", "a custom SELinux user or role is not allowed"))
        if se.get("type", "") not in SELINUX_TYPES:
            out.append((f"{where}.seLinuxOptions.type", f"{se.get('type')!r} is not allowed; use one of "
                        f"{', '.join(sorted(t for t in SELINUX_TYPES if t))}"))
    if pod_level:
        for i, s in enumerate(sc.get("sysctls") or []):
            name = s.get("name") if isinstance(s, dict) else None
            if name not in SAFE_SYSCTLS:
                out.append((f"{where}.sysctls[{i}].name", f"{name!r} is not a namespaced, safe sysctl"))
    if policy.level == "restricted":
        if sc.get("runAsNonRoot") is False:
            out.append((f"{where}.runAsNonRoot", "the restricted policy runs nothing as root: remove it"))
        if sc.get("runAsUser") == 0:
            out.append((f"{where}.runAsUser", "0 is root; the restricted policy runs nothing as root: use a UID "
                                              "above 0"))


def _capabilities(sc: Any, where: str, policy: PodPolicy, out: Out, require_drop: bool) -> None:
    caps = (sc or {}).get("capabilities") if isinstance(sc, dict) else None
    caps = caps if isinstance(caps, dict) else {}
    allowed = (RESTRICTED_CAPABILITIES if policy.level == "restricted" else BASELINE_CAPABILITIES) | \
        policy.capabilities
    for i, cap in enumerate(caps.get("add") or []):
        if _cap(cap) not in allowed:
            out.append((f"{where}.capabilities.add[{i}]",
                        f"{cap} is not allowed by the {policy.level} pod policy; the cluster admin can allowlist it "
                        f"(chart value podPolicy.capabilities, e.g. IPC_LOCK for RDMA)"))
    if require_drop:
        if "ALL" not in [str(c).upper() for c in caps.get("drop") or []]:
            out.append((f"{where}.capabilities.drop", "the restricted pod policy needs drop: [ALL]"))
        if (sc or {}).get("allowPrivilegeEscalation") is not False:
            out.append((f"{where}.allowPrivilegeEscalation", "the restricted pod policy needs false"))


def _container(c: Any, where: str, policy: PodPolicy, out: Out, operator_hardened: bool) -> None:
    if not isinstance(c, dict):
        return
    sc = c.get("securityContext")
    _security_context(sc, f"{where}.securityContext", policy, out)
    # The trainer container's override: the operator already drops ALL and forbids escalation on it.
    _capabilities(sc, f"{where}.securityContext", policy, out,
                  require_drop=policy.level == "restricted" and not operator_hardened)
    for i, p in enumerate(c.get("ports") or []):
        if isinstance(p, dict) and p.get("hostPort"):
            out.append((f"{where}.ports[{i}].hostPort", "host ports bind the node's network: remove it"))


def _volume(v: Any, where: str, policy: PodPolicy, out: Out) -> None:
    if not isinstance(v, dict):
        return
    if "hostPath" in v:
        path = str((v.get("hostPath") or {}).get("path", ""))
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


def _node_terms(affinity: Any) -> Iterable[tuple[str, dict[str, Any]]]:
    na = (affinity or {}).get("nodeAffinity") if isinstance(affinity, dict) else None
    if not isinstance(na, dict):
        return
    req = na.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    for t, term in enumerate(req.get("nodeSelectorTerms") or [] if isinstance(req, dict) else []):
        yield f"affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{t}]", term
    for t, pref in enumerate(na.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
        if isinstance(pref, dict):
            yield (f"affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[{t}].preference",
                   pref.get("preference") or {})


def _placement(spec: dict[str, Any], policy: PodPolicy, out: Out) -> None:
    for key in spec.get("nodeSelector") or {}:
        if key in CONTROL_PLANE_KEYS:
            out.append((f"nodeSelector.{key}", "selects control-plane nodes: trainers run on worker nodes"))
    for where, term in _node_terms(spec.get("affinity")):
        for i, expr in enumerate((term or {}).get("matchExpressions") or []):
            if isinstance(expr, dict) and expr.get("key") in CONTROL_PLANE_KEYS and \
                    expr.get("operator") in ("In", "Exists"):
                out.append((f"{where}.matchExpressions[{i}].key",
                            "selects control-plane nodes: trainers run on worker nodes"))
    for i, t in enumerate(spec.get("tolerations") or []):
        if not isinstance(t, dict):
            continue
        if t.get("operator") == "Exists" and not t.get("key"):
            out.append((f"tolerations[{i}]", "operator Exists without a key tolerates every taint (control-plane, "
                                             "not-ready, dedicated nodes): name the taint's key"))
        elif t.get("key") in CONTROL_PLANE_KEYS:
            out.append((f"tolerations[{i}].key", "tolerates the control-plane taint: trainers run on worker nodes"))


def _identity(spec: dict[str, Any], policy: PodPolicy, out: Out) -> None:
    sa = spec.get("serviceAccountName")
    if sa and sa not in policy.service_accounts:
        allowed = ", ".join(sorted(policy.service_accounts)) or "none"
        out.append(("serviceAccountName", f"{sa!r} is not in the pod policy's allowlist ({allowed}); the cluster "
                                          f"admin lists trainer ServiceAccounts in the chart value "
                                          f"podPolicy.serviceAccounts"))
    if spec.get("automountServiceAccountToken") and not (sa and sa in policy.service_accounts):
        out.append(("automountServiceAccountToken", "a token is mounted only for an allowlisted serviceAccountName "
                                                    "(the namespace's default account is not one): remove it"))
    pc = spec.get("priorityClassName")
    if pc and pc not in policy.priority_classes and (policy.priority_classes or str(pc).startswith("system-")):
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
        for i, c in enumerate(spec.get(kind) or []):
            name = c.get("name") if isinstance(c, dict) else None
            _container(c, f"{kind}[{i}]", policy, out, operator_hardened=kind == "containers" and name in hardened)
    for i, v in enumerate(spec.get("volumes") or []):
        _volume(v, f"volumes[{i}]", policy, out)
    _placement(spec, policy, out)
    _identity(spec, policy, out)
    for key, value in (annotations or {}).items():
        if key.startswith(_APPARMOR_ANNOTATION) and value == "unconfined":
            out.append((f"@annotations.{key}", "unconfined lifts AppArmor: use runtime/default"))
    return out


# Where each PodSpec field of the view below comes from in a SeqTrainJob.
_FROM_SCHEDULING = {"nodeSelector": "spec.scheduling.nodeSelector", "tolerations": "spec.scheduling.tolerations",
                    "priorityClassName": "spec.scheduling.priorityClassName"}


def job_policy_problems(spec: Any, policy: PodPolicy) -> list[Problem]:
    """Problems of a JobSpec (seqtrain.spec.job.JobSpec) under `policy`, named by the SeqTrainJob field."""
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
    return out
