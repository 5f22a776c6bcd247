"""The user guide's pod policy table (docs/user-guide.md, "Pod templates" under Security), row by row.

Each row of that table is one `Row` here: a rule, and for each level whether a job breaking it is admitted. Every
case of a row is a job that breaks the rule in one way (init containers and sidecars included), checked the way
`seqtrain validate`, the webhook and reconcile check it: the spec models and operator-owned fields
(`parse_job`), then the pod policy of the level (`job_policy_problems`). A test keeps the table's rows and these
equal, so the guide cannot promise a rule nobody checks.
"""

from __future__ import annotations

import copy
import pathlib
import re
from dataclasses import dataclass
from typing import Any

import pytest

from jobs import make_job
from seqtrain.spec import SpecError, parse_job
from seqtrain.spec.policy import PodPolicy, job_policy_problems

ROOT = pathlib.Path(__file__).resolve().parents[2]
T = "spec.podTemplate.spec"
A = "spec.podTemplate.metadata.annotations"
LEVELS = ("privileged", "baseline", "restricted")


def job(template: dict[str, Any] | None = None, *, meta: dict[str, Any] | None = None,
        **spec: Any) -> dict[str, Any]:
    return make_job("j", "ml", **{"replicas": 1, "resources": {"cpu": "1", "memory": "1Gi"},
                                  "training": {"steps": 10, "globalBatchSize": 4, "microBatchSize": 4},
                                  "podTemplate": {"spec": template or {}, "metadata": meta or {}}, **spec})


HARD = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def sidecar(**fields: Any) -> dict[str, Any]:
    """A sidecar that meets the restricted level except for what `fields` change."""
    sc = {**copy.deepcopy(HARD), **fields.pop("securityContext", {})}
    return {"name": "side", "image": "busybox", "securityContext": sc, **fields}


def pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (), **fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"containers": list(containers), **fields}
    if init:
        out["initContainers"] = [{**c, "name": f"init{i}"} for i, c in enumerate(init)]
    return out


def mounted(volume: dict[str, Any]) -> dict[str, Any]:
    return pod(sidecar(volumeMounts=[{"name": "v", "mountPath": "/v"}]), volumes=[{"name": "v", **volume}])


TOKEN = {"serviceAccountToken": {"audience": "vault", "path": "t"}}


@dataclass(frozen=True)
class Row:
    rule: str  # the table's first column, verbatim
    admitted: tuple[bool, bool, bool]  # privileged, baseline, restricted
    cases: tuple[tuple[str, dict[str, Any], str], ...]  # (case id, job, the field a refusal names)
    allow: tuple[tuple[str, tuple[str, ...]], ...] = ()  # the admin's allowlists for this row


ROWS = [
    Row("privileged or hostProcess containers", (True, False, False), (
        ("privileged sidecar", job(pod(sidecar(securityContext={"privileged": True}))),
         f"{T}.containers[0].securityContext.privileged"),
        ("hostProcess init", job(pod(init=(sidecar(securityContext={"windowsOptions": {"hostProcess": True}}),))),
         f"{T}.initContainers[0].securityContext.windowsOptions.hostProcess"))),
    Row("hostPath volumes", (True, False, False), (
        ("runtime socket", job(mounted({"hostPath": {"path": "/run/containerd/containerd.sock"}})),
         f"{T}.volumes[0].hostPath"),)),
    Row("hostPort", (True, False, False), (
        ("sidecar hostPort", job(pod(sidecar(ports=[{"containerPort": 22, "hostPort": 22}]))),
         f"{T}.containers[0].ports[0].hostPort"),)),
    Row("capabilities beyond the baseline list", (True, False, False), (
        ("NET_ADMIN sidecar", job(pod(sidecar(securityContext={"capabilities": {"add": ["NET_ADMIN"],
                                                                                 "drop": ["ALL"]}}))),
         f"{T}.containers[0].securityContext.capabilities.add[0]"),
        ("ALL init container", job(pod(init=(sidecar(securityContext={"capabilities": {"add": ["ALL"],
                                                                                         "drop": ["ALL"]}}),))),
         f"{T}.initContainers[0].securityContext.capabilities.add[0]"))),
    Row("SYS_ADMIN or ALL added to the trainer container", (False, False, False), (
        ("SYS_ADMIN", job(pod({"name": "trainer", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}})),
         f"{T}.containers[0].securityContext.capabilities.add[0]"),
        ("ALL", job(pod({"name": "trainer", "securityContext": {"capabilities": {"add": ["ALL"]}}})),
         f"{T}.containers[0].securityContext.capabilities.add[0]"),
        ("CAP_ALL", job(pod({"name": "trainer", "securityContext": {"capabilities": {"add": ["CAP_ALL"]}}})),
         f"{T}.containers[0].securityContext.capabilities.add[0]"))),
    Row("capabilities beyond NET_BIND_SERVICE", (True, True, False), (
        ("CHOWN on the trainer", job(pod({"name": "trainer", "securityContext": {"capabilities": {"add": ["CHOWN"]}}})),
         f"{T}.containers[0].securityContext.capabilities.add[0]"),)),
    Row("an allowlisted capability (podPolicy.capabilities)", (True, True, True), (
        ("IPC_LOCK for RDMA", job(pod({"name": "trainer", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}})),
         f"{T}.containers[0].securityContext.capabilities.add[0]"),),
        allow=(("capabilities", ("IPC_LOCK",)),)),
    Row("Unconfined seccomp or AppArmor", (True, False, False), (
        ("seccomp", job(pod(sidecar(securityContext={"seccompProfile": {"type": "Unconfined"}}))),
         f"{T}.containers[0].securityContext.seccompProfile.type"),
        ("apparmor init", job(pod(init=(sidecar(securityContext={"appArmorProfile": {"type": "Unconfined"}}),))),
         f"{T}.initContainers[0].securityContext.appArmorProfile.type"))),
    Row("legacy seccomp and AppArmor annotations", (True, False, False), (
        ("seccomp pod", job(meta={"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}}),
         f"{A}.seccomp.security.alpha.kubernetes.io/pod"),
        ("seccomp container", job(meta={"annotations": {
            "container.seccomp.security.alpha.kubernetes.io/side": "runtime/default"}}),
         f"{A}.container.seccomp.security.alpha.kubernetes.io/side"),
        ("apparmor runtime/default", job(meta={"annotations": {
            "container.apparmor.security.beta.kubernetes.io/trainer": "localhost/custom"}}),
         f"{A}.container.apparmor.security.beta.kubernetes.io/trainer"))),
    Row("custom SELinux user, role or type", (True, False, False), (
        ("spc_t", job(pod(sidecar(securityContext={"seLinuxOptions": {"type": "spc_t"}}))),
         f"{T}.containers[0].securityContext.seLinuxOptions.type"),)),
    Row("unmasked /proc", (True, False, False), (
        ("procMount", job(pod(init=(sidecar(securityContext={"procMount": "Unmasked"}),))),
         f"{T}.initContainers[0].securityContext.procMount"),)),
    Row("mount propagation other than None", (True, False, False), (
        ("Bidirectional", job(pod(sidecar(volumeMounts=[{"name": "v", "mountPath": "/v",
                                                         "mountPropagation": "Bidirectional"}]),
                                  volumes=[{"name": "v", "emptyDir": {}}])),
         f"{T}.containers[0].volumeMounts[0].mountPropagation"),
        ("HostToContainer on the trainer", job(pod({"name": "trainer", "volumeMounts": [
            {"name": "v", "mountPath": "/data", "mountPropagation": "HostToContainer"}]},
            volumes=[{"name": "v", "emptyDir": {}}])),
         f"{T}.containers[0].volumeMounts[0].mountPropagation"))),
    Row("serviceAccountName not in podPolicy.serviceAccounts", (True, False, False), (
        ("admin", job(pod(serviceAccountName="admin")), f"{T}.serviceAccountName"),)),
    Row("a ServiceAccount token without an allowlisted serviceAccountName", (True, False, False), (
        ("automount", job(pod(automountServiceAccountToken=True)), f"{T}.automountServiceAccountToken"),
        ("projected token of the default account", job(mounted({"projected": {"sources": [TOKEN]}})),
         f"{T}.volumes[0].projected.sources[0].serviceAccountToken"),
        ("projected token in an init container's volume", job({**pod(init=(sidecar(volumeMounts=[
            {"name": "v", "mountPath": "/v"}]),)), "volumes": [{"name": "v", "projected": {"sources": [TOKEN]}}]}),
         f"{T}.volumes[0].projected.sources[0].serviceAccountToken")),
        allow=(("service_accounts", ("trainer-sa",)),)),
    Row("an allowlisted ServiceAccount and its token", (True, True, True), (
        ("automount", job(pod(serviceAccountName="trainer-sa", automountServiceAccountToken=True)),
         f"{T}.automountServiceAccountToken"),
        ("projected", job({**mounted({"projected": {"sources": [TOKEN]}}), "serviceAccountName": "trainer-sa"}),
         f"{T}.volumes[0].projected.sources[0].serviceAccountToken")),
        allow=(("service_accounts", ("trainer-sa",)),)),
    Row("Secrets, no podPolicy.secrets set", (True, True, False), (
        ("secret volume", job(mounted({"secret": {"secretName": "db"}})), f"{T}.volumes[0].secret.secretName"),
        ("projected secret", job(mounted({"projected": {"sources": [{"secret": {"name": "db"}}]}})),
         f"{T}.volumes[0].projected.sources[0].secret.name"),
        ("envFrom on the trainer", job(pod({"name": "trainer", "envFrom": [{"secretRef": {"name": "db"}}]})),
         f"{T}.containers[0].envFrom[0].secretRef.name"),
        ("secretKeyRef in an init container", job(pod(init=(sidecar(env=[{"name": "P", "valueFrom": {
            "secretKeyRef": {"name": "db", "key": "p"}}}]),))),
         f"{T}.initContainers[0].env[0].valueFrom.secretKeyRef.name"),
        ("csi nodePublishSecretRef", job(mounted({"csi": {"driver": "x", "nodePublishSecretRef": {"name": "db"}}})),
         f"{T}.volumes[0].csi.nodePublishSecretRef.name"))),
    Row("Secrets not in podPolicy.secrets", (True, False, False), (
        ("secret volume", job(mounted({"secret": {"secretName": "db"}})), f"{T}.volumes[0].secret.secretName"),
        ("envFrom in a sidecar", job(pod(sidecar(envFrom=[{"secretRef": {"name": "db"}}]))),
         f"{T}.containers[0].envFrom[0].secretRef.name")),
        allow=(("secrets", ("hf-token",)),)),
    Row("Secrets in podPolicy.secrets", (True, True, True), (
        ("secret volume", job(mounted({"secret": {"secretName": "hf-token"}})), f"{T}.volumes[0].secret.secretName"),
        ("secretKeyRef on the trainer", job(pod({"name": "trainer", "env": [{"name": "HF_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": "hf-token", "key": "t"}}}]})),
         f"{T}.containers[0].env[0].valueFrom.secretKeyRef.name")),
        allow=(("secrets", ("hf-token",)),)),
    Row("checkpoint.path outside /checkpoints/<job>", (True, False, False), (
        ("another job's folder", job(checkpoint={"path": "/checkpoints/other/checkpoints"}), "spec.checkpoint.path"),
        ("the claim's root", job(checkpoint={"path": "/checkpoints"}), "spec.checkpoint.path"),
        ("a name that starts like the job's", job(checkpoint={"path": "/checkpoints/j2"}), "spec.checkpoint.path"),
        ("elsewhere", job(checkpoint={"path": "/etc/ck"}), "spec.checkpoint.path"),
        ("relative", job(checkpoint={"path": "ck"}), "spec.checkpoint.path"))),
    Row("checkpoint.path inside /checkpoints/<job>", (True, True, True), (
        ("below", job(checkpoint={"path": "/checkpoints/j/ck"}), "spec.checkpoint.path"),
        ("the folder", job(checkpoint={"path": "/checkpoints/j/"}), "spec.checkpoint.path"))),
    Row("tolerations of every taint or of the control-plane taint", (True, False, False), (
        ("Exists without key", job(scheduling={"tolerations": [{"operator": "Exists"}]}),
         "spec.scheduling.tolerations[0]"),)),
    Row("control-plane nodes in nodeSelector or node affinity", (True, False, False), (
        ("nodeSelector", job(scheduling={"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}),
         "spec.scheduling.nodeSelector.node-role.kubernetes.io/control-plane"),)),
    Row("system-* priority classes", (True, False, False), (
        ("system-node-critical", job(scheduling={"priorityClassName": "system-node-critical"}),
         "spec.scheduling.priorityClassName"),)),
    Row("volumes other than the restricted kinds", (True, True, False), (
        ("nfs", job(mounted({"nfs": {"server": "n", "path": "/x"}})), f"{T}.volumes[0].nfs"),)),
    Row("sidecars or init containers without drop ALL and allowPrivilegeEscalation false", (True, True, False), (
        ("sidecar", job(pod({"name": "side", "image": "busybox"})),
         f"{T}.containers[0].securityContext.capabilities.drop"),
        ("init", job(pod(init=({"image": "busybox", "securityContext": {"capabilities": {"drop": ["ALL"]}}},))),
         f"{T}.initContainers[0].securityContext.allowPrivilegeEscalation"))),
    Row("running as root", (True, True, False), (
        ("runAsUser 0", job(pod(sidecar(securityContext={"runAsUser": 0}))),
         f"{T}.containers[0].securityContext.runAsUser"),)),
    Row("operator-owned fields", (False, False, False), (
        ("rank env", job(pod({"name": "trainer", "env": [{"name": "RANK", "value": "0"}]})),
         f"{T}.containers[0].env[0].name"),
        ("seqtrain env", job(pod({"name": "trainer", "env": [{"name": "SEQTRAIN_JOB", "value": "x"}]})),
         f"{T}.containers[0].env[0].name"),
        ("trainer image", job(pod({"name": "trainer", "image": "evil"})), f"{T}.containers[0].image"))),
    Row("the trainer settings the guide documents in the trainer's env", (True, True, True), (
        ("SEQTRAIN_CHECKPOINT_TIMEOUT_SECONDS", job(pod({"name": "trainer", "env": [
            {"name": "SEQTRAIN_CHECKPOINT_TIMEOUT_SECONDS", "value": "3600"}]})), f"{T}.containers[0].env[0].name"),
        ("SEQTRAIN_CHECKPOINT_WRITER", job(pod({"name": "trainer", "env": [
            {"name": "SEQTRAIN_CHECKPOINT_WRITER", "value": "process"}]})), f"{T}.containers[0].env[0].name"),
        ("SEQTRAIN_KERNELS", job(pod({"name": "trainer", "env": [
            {"name": "SEQTRAIN_KERNELS", "value": "torch"}]})), f"{T}.containers[0].env[0].name"))),
    Row("names Kubernetes refuses", (False, False, False), (
        ("label key", job(meta={"labels": {"bad key!": "x"}}), "spec.podTemplate.metadata.labels.bad key!"),
        ("label value", job(meta={"labels": {"team": "a" * 64}}), "spec.podTemplate.metadata.labels.team"),
        ("annotation key", job(meta={"annotations": {"-x": "y"}}), f"{A}.-x"),
        ("annotations over 256 KiB (the whole document's bound comes first)",
         job(meta={"annotations": {f"k{i}": "v" * 60_000 for i in range(5)}}), "<document>"),
        ("volume name", job(pod(volumes=[{"name": "Data_1", "emptyDir": {}}])), f"{T}.volumes[0].name"),
        ("container name", job(pod(sidecar(name="s" * 64))), f"{T}.containers[0].name"),
        ("env var name", job(pod(sidecar(env=[{"name": "1=x", "value": "y"}]))), f"{T}.containers[0].env[0].name"),
        ("init container env var name", job(pod(init=(sidecar(env=[{"name": "A B", "value": "y"}]),))),
         f"{T}.initContainers[0].env[0].name"),
        ("nodeSelector value", job(scheduling={"nodeSelector": {"pool": "a b"}}), "spec.scheduling.nodeSelector.pool"),
        ("topology key", job(scheduling={"topology": {"policy": "pack", "keys": ["bad key"]}}),
         "spec.scheduling.topology.keys[0]"))),
]


def policy(level: str, allow: tuple[tuple[str, tuple[str, ...]], ...]) -> PodPolicy:
    return PodPolicy.of(level, **dict(allow))


def refusals(doc: dict[str, Any], pol: PodPolicy) -> dict[str, str]:
    """field -> message, as `seqtrain validate --policy` reports them."""
    try:
        parsed = parse_job(copy.deepcopy(doc))
    except SpecError as err:
        return {p.path: p.message for p in err.problems}
    return {p.path: p.message for p in job_policy_problems(parsed.spec, pol, parsed.name)}


CASES = [pytest.param(row, level, admitted, doc, path, id=f"{row.rule}|{case}|{level}")
         for row in ROWS for case, doc, path in row.cases for level, admitted in
         zip(LEVELS, row.admitted, strict=True)]


@pytest.mark.parametrize("row,level,admitted,doc,path", CASES)
def test_each_row_of_the_table_at_each_level(row: Row, level: str, admitted: bool, doc: dict[str, Any],
                                             path: str) -> None:
    got = refusals(doc, policy(level, row.allow))
    if admitted:
        assert path not in got, got
        assert got == {}, got  # the case breaks this rule only
    else:
        assert path in got, got
        assert got[path] and "\n" not in got[path]


def _guide_rows() -> list[str]:
    text = (ROOT / "docs" / "user-guide.md").read_text()
    section = text.split("### Pod templates", 1)[1].split("\n### ", 1)[0]
    table = section.split("| rule | privileged | baseline | restricted |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.strip().splitlines()[1:] if line.startswith("|")]
    out = []
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out.append((cells[0], tuple(c.startswith("allowed") for c in cells[1:4])))
    return out


def test_the_guides_table_is_this_table() -> None:
    guide = _guide_rows()
    ours = [(re.sub(r"\s+", " ", r.rule), r.admitted) for r in ROWS]
    assert [(re.sub(r"`", "", rule), admitted) for rule, admitted in guide] == ours


def test_validate_and_the_operator_take_the_secret_allowlist(tmp_path: pathlib.Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`seqtrain validate --allow-secret` and the operator's `--allow-secret` (chart value podPolicy.secrets)."""
    import yaml

    from seqtrain_operator import cli
    from seqtrain_operator.k8s.main import build_parser

    f = tmp_path / "j.yaml"
    f.write_text(yaml.safe_dump(job(pod({"name": "trainer", "envFrom": [{"secretRef": {"name": "db"}}]}))))
    assert cli.main(["validate", str(f), "--policy", "restricted"]) == 2
    assert f"{T}.containers[0].envFrom[0].secretRef.name" in capsys.readouterr().err
    assert cli.main(["validate", str(f), "--policy", "restricted", "--allow-secret", "db"]) == 0
    args = build_parser().parse_args(["--allow-secret", "db", "--allow-secret", "*"])
    assert args.allow_secret == ["db", "*"]
