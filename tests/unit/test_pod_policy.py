"""The pod policy (seqtrain.spec.policy): one module, one table; `seqtrain validate`, the webhook and the operator's
reconcile all hold a job's pod template and scheduling fields to it."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys

import kopf
import pytest
from test_admission_lock import Index, Kube

from seqtrain.spec import parse_job
from seqtrain.spec.policy import PodPolicy, job_policy_problems, pod_spec_problems
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.passes import reconcile
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.process import handlers
from seqtrain_operator.k8s.process.runtime import Runtime
from seqtrain_operator.k8s.settings import Settings
from seqtrain_operator.planner.types import Layout, Plan, ReplicaAssignment

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Job:
    """MakeJob(...).obj() style builder of a SeqTrainJob document."""

    def __init__(self, name: str = "j") -> None:
        self.doc = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob",
                    "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "resourceVersion": "1",
                                 "generation": 1},
                    "spec": {"replicas": 1, "resources": {"cpu": "1", "memory": "1Gi"},
                             "training": {"steps": 10, "globalBatchSize": 4, "microBatchSize": 4},
                             "podTemplate": {"spec": {}}}}

    @property
    def _t(self) -> dict:
        return self.doc["spec"]["podTemplate"]["spec"]

    def sidecar(self, **fields: object) -> Job:
        self._t.setdefault("containers", []).append({"name": f"side{len(self._t.get('containers', []))}",
                                                     "image": "busybox", **fields})
        return self

    def init(self, **fields: object) -> Job:
        self._t.setdefault("initContainers", []).append({"name": "init", "image": "busybox", **fields})
        return self

    def trainer_caps(self, *caps: str) -> Job:
        self._t.setdefault("containers", []).insert(
            0, {"name": "trainer", "securityContext": {"capabilities": {"add": list(caps)}}})
        return self

    def volume(self, **source: object) -> Job:
        self._t.setdefault("volumes", []).append({"name": f"v{len(self._t.get('volumes', []))}", **source})
        return self

    def pod(self, **fields: object) -> Job:
        self._t.update(fields)
        return self

    def scheduling(self, **fields: object) -> Job:
        self.doc["spec"]["scheduling"] = fields
        return self

    def obj(self) -> dict:
        return self.doc


def found(job: Job, policy: PodPolicy) -> dict[str, str]:
    return {p.path: p.message for p in job_policy_problems(parse_job(job.obj()).spec, policy)}


T = "spec.podTemplate.spec"
HOSTILE = [  # (job, field named, words in the message): each refused by baseline (and so by restricted)
    (Job().sidecar(securityContext={"privileged": True}), f"{T}.containers[0].securityContext.privileged", "privileged"),
    (Job().init(securityContext={"privileged": True}), f"{T}.initContainers[0].securityContext.privileged", "privileged"),
    (Job().volume(hostPath={"path": "/"}), f"{T}.volumes[0].hostPath", "node's own filesystem"),
    (Job().volume(hostPath={"path": "/run/containerd/containerd.sock"}), f"{T}.volumes[0].hostPath",
     "container runtime's socket"),
    (Job().volume(hostPath={"path": "/var/run/docker.sock", "type": "Socket"}), f"{T}.volumes[0].hostPath", "socket"),
    (Job().pod(serviceAccountName="admin"), f"{T}.serviceAccountName", "allowlist"),
    (Job().pod(automountServiceAccountToken=True), f"{T}.automountServiceAccountToken", "allowlisted"),
    (Job().scheduling(tolerations=[{"operator": "Exists"}]), "spec.scheduling.tolerations[0]", "every taint"),
    (Job().scheduling(tolerations=[{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
                                    "effect": "NoSchedule"}]), "spec.scheduling.tolerations[0].key", "control-plane"),
    (Job().scheduling(nodeSelector={"node-role.kubernetes.io/control-plane": ""}),
     "spec.scheduling.nodeSelector.node-role.kubernetes.io/control-plane", "control-plane"),
    (Job().pod(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}]}]}}}),
     f"{T}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
     ".matchExpressions[0].key", "control-plane"),
    (Job().scheduling(priorityClassName="system-node-critical"), "spec.scheduling.priorityClassName", "system-"),
    (Job().trainer_caps("SYS_MODULE"), f"{T}.containers[0].securityContext.capabilities.add[0]", "SYS_MODULE"),
    (Job().trainer_caps("IPC_LOCK"), f"{T}.containers[0].securityContext.capabilities.add[0]", "allowlist"),
    (Job().sidecar(securityContext={"capabilities": {"add": ["NET_ADMIN"]}}),
     f"{T}.containers[0].securityContext.capabilities.add[0]", "NET_ADMIN"),
    (Job().sidecar(ports=[{"containerPort": 22, "hostPort": 22}]), f"{T}.containers[0].ports[0].hostPort", "host"),
    (Job().init(securityContext={"procMount": "Unmasked"}), f"{T}.initContainers[0].securityContext.procMount",
     "/proc"),
    (Job().sidecar(securityContext={"seccompProfile": {"type": "Unconfined"}}),
     f"{T}.containers[0].securityContext.seccompProfile.type", "RuntimeDefault"),
    (Job().sidecar(securityContext={"appArmorProfile": {"type": "Unconfined"}}),
     f"{T}.containers[0].securityContext.appArmorProfile.type", "AppArmor"),
    (Job().sidecar(securityContext={"seLinuxOptions": {"type": "spc_t"}}),
     f"{T}.containers[0].securityContext.seLinuxOptions.type", "spc_t"),
    (Job().sidecar(securityContext={"windowsOptions": {"hostProcess": True}}),
     f"{T}.containers[0].securityContext.windowsOptions.hostProcess", "host"),
    # a native sidecar (an init container that keeps running) is held to the same rules
    (Job().init(restartPolicy="Always", securityContext={"capabilities": {"add": ["SYS_PTRACE"]}}),
     f"{T}.initContainers[0].securityContext.capabilities.add[0]", "SYS_PTRACE"),
]


@pytest.mark.parametrize("job,path,words", HOSTILE)
def test_baseline_and_restricted_refuse_each_escalation_naming_the_field(job, path, words):
    for level in ("baseline", "restricted"):
        got = found(job, PodPolicy.of(level))
        assert path in got, got
        assert words in got[path] and f"[pod policy {level}]" in got[path]
    assert found(job, PodPolicy.of("privileged")) == {}


RESTRICTED_ONLY = [
    (Job().sidecar(), f"{T}.containers[0].securityContext.capabilities.drop", "drop: [ALL]"),
    (Job().sidecar(), f"{T}.containers[0].securityContext.allowPrivilegeEscalation", "false"),
    (Job().init(securityContext={"runAsUser": 0, "allowPrivilegeEscalation": False,
                                 "capabilities": {"drop": ["ALL"]}}),
     f"{T}.initContainers[0].securityContext.runAsUser", "root"),
    (Job().sidecar(securityContext={"runAsNonRoot": False}), f"{T}.containers[0].securityContext.runAsNonRoot", "root"),
    (Job().volume(nfs={"server": "nfs", "path": "/x"}), f"{T}.volumes[0].nfs", "restricted"),
    (Job().trainer_caps("CHOWN"), f"{T}.containers[0].securityContext.capabilities.add[0]", "CHOWN"),
]


@pytest.mark.parametrize("job,path,words", RESTRICTED_ONLY)
def test_restricted_adds_the_hardening_baseline_leaves_out(job, path, words):
    got = found(job, PodPolicy.of("restricted"))
    assert path in got and words in got[path], got
    assert path not in found(job, PodPolicy.of("baseline"))


def hardened(**sc: object) -> dict:
    return {"securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, **sc}}


def test_ordinary_templates_pass_restricted():
    job = (Job().trainer_caps("NET_BIND_SERVICE").sidecar(**hardened()).init(**hardened(runAsUser=1000))
           .volume(persistentVolumeClaim={"claimName": "data"}).volume(secret={"secretName": "s"})
           .volume(emptyDir={}).scheduling(priorityClassName="training",
                                           tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}],
                                           nodeSelector={"pool": "a100"}))
    assert found(job, PodPolicy.of("restricted", secrets=["s"])) == {}  # restricted: Secrets only if allowlisted


def test_allowlists_admit_exactly_what_the_admin_listed():
    rdma = Job().trainer_caps("IPC_LOCK").pod(serviceAccountName="trainer-sa", automountServiceAccountToken=True)
    policy = PodPolicy.of("baseline", service_accounts=["trainer-sa"], capabilities=["CAP_IPC_LOCK"])
    assert found(rdma, policy) == {}
    assert set(found(rdma, PodPolicy.of("baseline", capabilities=["IPC_LOCK"]))) == {
        f"{T}.serviceAccountName", f"{T}.automountServiceAccountToken"}
    prio = Job().scheduling(priorityClassName="high")
    assert found(prio, PodPolicy.of()) == {}  # no priority allowlist: any class but system-*
    assert "spec.scheduling.priorityClassName" in found(prio, PodPolicy.of(priority_classes=["low"]))
    crit = Job().scheduling(priorityClassName="system-cluster-critical")
    assert found(crit, PodPolicy.of(priority_classes=["system-cluster-critical"])) == {}


def test_the_operators_own_pods_pass_restricted():
    """The generic check over a whole PodSpec: what the operator generates (with an allowlisted RDMA override)
    meets the restricted level, so an admin can choose it."""
    job = parse_job(Job().trainer_caps("IPC_LOCK").volume(persistentVolumeClaim={"claimName": "d"}).obj())
    plan = Plan(world_size=1, procs_per_replica=1, layout=Layout(dp=1), replicas=(ReplicaAssignment(0, "n", (0,)),))
    pod = m.build_gang(job, Owner("j", "ml", "u"), 1, m.Settings(), plan).pods[0]
    assert pod_spec_problems(pod["spec"], PodPolicy.of("restricted", capabilities=["IPC_LOCK"])) == []
    assert [p for p, _ in pod_spec_problems(pod["spec"], PodPolicy.of("restricted"))] == [
        "containers[0].securityContext.capabilities.add[0]"]


HOSTILE_YAML = """\
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: evil}
spec:
  scheduling:
    priorityClassName: system-node-critical
    nodeSelector: {node-role.kubernetes.io/control-plane: ""}
    tolerations: [{operator: Exists}]
  podTemplate:
    spec:
      serviceAccountName: admin
      automountServiceAccountToken: true
      containers:
      - {name: trainer, securityContext: {capabilities: {add: [IPC_LOCK]}}}
      - name: root
        image: busybox
        securityContext: {privileged: true, runAsUser: 0}
        volumeMounts: [{name: host, mountPath: /host}]
      volumes:
      - {name: host, hostPath: {path: /}}
"""


def validate_cli(path: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "seqtrain_operator.cli", "validate", str(path), *flags],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": f"{ROOT / 'trainer'}:{ROOT / 'operator'}", "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_validate_exits_2_with_one_line_per_offending_field(tmp_path):
    f = tmp_path / "evil.yaml"
    f.write_text(HOSTILE_YAML)
    out = validate_cli(f)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    fields = [line.split(": ")[1] for line in lines]
    assert all(line.startswith(f"{f}: ") for line in lines) and "Traceback" not in out.stderr
    assert fields == [f"{T}.containers[0].securityContext.capabilities.add[0]",
                      f"{T}.containers[1].securityContext.privileged", f"{T}.volumes[0].hostPath",
                      "spec.scheduling.nodeSelector.node-role.kubernetes.io/control-plane",
                      "spec.scheduling.tolerations[0]", f"{T}.serviceAccountName",
                      f"{T}.automountServiceAccountToken", "spec.scheduling.priorityClassName"]
    assert validate_cli(f, "--policy", "privileged").returncode == 0
    allowed = validate_cli(f, "--allow-capability", "IPC_LOCK", "--allow-service-account", "admin")
    assert allowed.returncode == 2 and "capabilities" not in allowed.stderr and "serviceAccount" not in allowed.stderr


def test_the_webhook_refuses_with_the_operators_policy():
    body = Job().trainer_caps("IPC_LOCK").obj()
    with pytest.raises(kopf.AdmissionError) as err:
        handlers.validate(body, operation="CREATE")
    assert f"{T}.containers[0].securityContext.capabilities.add[0]" in str(err.value)
    pods = m.Settings(pod_policy=PodPolicy.of(capabilities=["IPC_LOCK"]))
    memo = handlers.memo_of(Runtime(Settings(pods=pods)))  # what kopf hands every handler
    handlers.validate(body, operation="CREATE", memo=memo)


def _reconcile(body: dict, settings: m.Settings) -> tuple[Kube, reconcile.Outcome]:
    kube = Kube(body)
    r = reconcile.Reconciler(kube, Settings(pods=settings, poll_progress=False))  # type: ignore[arg-type]
    outcome = asyncio.run(r.reconcile("ml", body["metadata"]["name"], lambda *a: None, Index()))
    return kube, outcome


def test_reconcile_creates_no_pod_a_policy_refuses_and_fails_the_job_naming_the_field():
    """The webhook may be off, or the policy stricter than when the job was admitted: reconcile checks it too."""
    body = Job().volume(hostPath={"path": "/"}).obj()
    body["spec"]["podTemplate"]["spec"]["containers"] = [
        {"name": "s", "image": "x", "volumeMounts": [{"name": "v0", "mountPath": "/host"}]}]
    kube, outcome = _reconcile(body, m.Settings())
    assert kube.created == []
    assert outcome.status is not None and outcome.status.phase == "Failed"
    failed = next(c for c in outcome.status.conditions if c.type == "Failed")
    assert failed.reason == "PodPolicy" and f"{T}.volumes[0].hostPath" in failed.message
    kube, outcome = _reconcile(body, m.Settings(pod_policy=PodPolicy.of("privileged")))
    assert [o["kind"] for o in kube.created if o["kind"] == "Pod"] == ["Pod"]


def test_network_policy_is_created_with_the_gang_when_configured():
    settings = m.Settings(network_policy=True, operator_namespace="seqtrain-system",
                          operator_labels={"app.kubernetes.io/name": "seqtrain"})
    kube, _ = _reconcile(Job().obj(), settings)
    kinds = [o["kind"] for o in kube.created]
    assert kinds.index("NetworkPolicy") < kinds.index("Pod")
    kube, _ = _reconcile(Job().obj(), m.Settings())
    assert "NetworkPolicy" not in [o["kind"] for o in kube.created]


def test_network_policy_admits_only_the_gang_and_the_operator():
    job = parse_job(Job().obj())
    owner = Owner("j", "ml", "u")
    settings = m.Settings(progress_port=8471, operator_namespace="seqtrain-system",
                          operator_labels={"app.kubernetes.io/name": "seqtrain"})
    np = m.build_network_policy(job, owner, settings)
    assert np["metadata"]["ownerReferences"][0]["uid"] == "u"
    spec = np["spec"]
    assert spec["podSelector"] == {"matchLabels": m.job_labels("j")} and spec["policyTypes"] == ["Ingress"]
    gang, operator = spec["ingress"]
    assert gang == {"from": [{"podSelector": {"matchLabels": m.job_labels("j")}}]}  # every port: gloo/NCCL pick theirs
    assert operator["ports"] == [{"protocol": "TCP", "port": 8471}]
    assert operator["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "seqtrain"}},
                                 "namespaceSelector": {"matchLabels": {
                                     "kubernetes.io/metadata.name": "seqtrain-system"}}}]
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(np, "1.33", strict=True)  # what the API server will accept
    with_metrics = m.build_network_policy(parse_job(Job().obj()), owner,
                                          m.Settings(progress_port=None, metrics_port=9400))
    assert with_metrics["spec"]["ingress"][1:] == [{"ports": [{"protocol": "TCP", "port": 9400}]}]
