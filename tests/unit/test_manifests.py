"""Manifest builders: the objects of a gang, checked field by field for what a user or the cluster relies on."""

from __future__ import annotations

import json

import pytest

from jobs import make_job
from seqtrain.spec import SeqTrainJob, TrainerConfig, resolve
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.planner.types import Layout, Plan, ReplicaAssignment

OWNER = Owner(name="gpt", namespace="ml", uid="1234-abcd")
SETTINGS = m.Settings()


def job(**spec):
    base = {"replicas": 2, "resources": {"gpus": 0, "cpu": "2", "memory": "3Gi"}}
    return SeqTrainJob.model_validate(make_job("gpt", "ml", **{**base, **spec}))


def env_of(pod):
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def plan(*nodes):
    return Plan(world_size=len(nodes), procs_per_replica=1, layout=Layout(dp=len(nodes)),
                replicas=tuple(ReplicaAssignment(i, n, (i,)) for i, n in enumerate(nodes)))


def test_every_object_is_owned_and_labelled():
    gang = m.build_gang(job(), OWNER, 3, SETTINGS, plan("a", "b"))
    objs = [gang.configmap, *gang.pods, m.build_service(OWNER, SETTINGS)]
    for obj in objs:
        ref = obj["metadata"]["ownerReferences"]
        assert ref == [{"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "name": "gpt",
                        "uid": "1234-abcd", "controller": True, "blockOwnerDeletion": True}]
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"][m.LABEL_JOB] == "gpt"
        assert obj["metadata"]["labels"][m.LABEL_UID] == "1234-abcd"  # a re-applied name is another job
    assert [p["metadata"]["name"] for p in gang.pods] == ["gpt-3-0", "gpt-3-1"]
    assert gang.pods[1]["metadata"]["labels"][m.LABEL_ATTEMPT] == "3"
    assert gang.pods[1]["metadata"]["labels"][m.LABEL_REPLICA] == "1"
    assert gang.podgroup is None


def test_pod_bootstrap_env_command_volumes_and_pinning():
    gang = m.build_gang(job(), OWNER, 1, SETTINGS, plan("node-a", "node-b"))
    pod = gang.pods[1]
    env = env_of(pod)
    assert env["MASTER_ADDR"] == "gpt-0.gpt.ml.svc" and env["MASTER_PORT"] == "29500"
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["seqtrain", "train", "--config", "/etc/seqtrain/config.json"]
    assert pod["spec"]["hostname"] == "gpt-1" and pod["spec"]["subdomain"] == "gpt"
    assert pod["spec"]["restartPolicy"] == "Never"
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert vols["config"]["configMap"]["name"] == "gpt-config-1"
    assert {vm["mountPath"] for vm in c["volumeMounts"]} >= {"/dev/shm", "/etc/seqtrain", "/checkpoints"}
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["node-b"]
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "3Gi"}
    assert "schedulerName" not in pod["spec"]


def test_security_context_is_restricted():
    pod = m.build_pod(job(), OWNER, 1, 0, SETTINGS)
    psc, csc = pod["spec"]["securityContext"], pod["spec"]["containers"][0]["securityContext"]
    assert psc["runAsNonRoot"] and psc["runAsUser"] != 0 and psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert csc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                   "capabilities": {"drop": ["ALL"]}}
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert psc["fsGroupChangePolicy"] == "OnRootMismatch"  # no recursive chown of the checkpoint claim per restart


def test_multi_process_pods_use_the_seqtrain_launcher_argv_without_shell():
    j = job(replicas=3, resources={"gpus": 4, "cpu": "8", "memory": "64Gi"}, image="reg/x:1; rm -rf /")
    pod = m.build_pod(j, OWNER, 2, 2, SETTINGS, "n1")
    c = pod["spec"]["containers"][0]
    # Our launcher, not torchrun: torchrun exits 1 for any failed rank, hiding exit code 3 (invalid config).
    assert c["command"] == ["seqtrain", "train", "--config", "/etc/seqtrain/config.json", "--nproc-per-node=4"]
    env = env_of(pod)
    assert "RANK" not in env and "LOCAL_RANK" not in env  # the launcher sets them per process
    assert (env["WORLD_SIZE"], env["NODE_RANK"], env["LOCAL_WORLD_SIZE"]) == ("12", "2", "4")
    assert env["MASTER_ADDR"] == "gpt-0.gpt.ml.svc" and env["MASTER_PORT"] == "29500"
    # The launcher gives up on its ranks before the kubelet's SIGKILL at terminationGracePeriodSeconds.
    assert int(env["SEQTRAIN_TERM_GRACE_SECONDS"]) < pod["spec"]["terminationGracePeriodSeconds"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4" and c["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert c["image"] == "reg/x:1; rm -rf /"  # passed verbatim as data, never interpreted


def test_configmap_holds_resolved_trainer_config():
    cm = m.build_configmap(job(checkpoint={"pvc": "ckpt"}), OWNER, 4, SETTINGS)
    cfg = TrainerConfig.model_validate(json.loads(cm["data"]["config.json"]))
    assert cfg.runtime.attempt == 4 and cfg.runtime.progress_port == 8471
    assert cfg.runtime.workdir == "/checkpoints/gpt" and cfg.runtime.checkpoint_dir == "/checkpoints/gpt/checkpoints"
    assert cfg.load_job().spec.model.dim is None  # derived by the trainer, where the files are
    assert resolve(cfg.load_job()).spec.model.dim == 64  # preset (tiny)
    assert cm["immutable"] is True
    pod = m.build_pod(job(checkpoint={"pvc": "ckpt"}), OWNER, 4, 0, SETTINGS)
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["checkpoints"] == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}}


def test_headless_service():
    svc = m.build_service(OWNER, SETTINGS)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {m.LABEL_JOB: "gpt", m.LABEL_MANAGED: m.MANAGER}


def test_scheduling_fields_pass_through():
    j = job(scheduling={"priorityClassName": "high", "nodeSelector": {"pool": "a"},
                        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
            resources={"gpus": 1, "gpuProduct": "NVIDIA-H100"})
    pod = m.build_pod(j, OWNER, 1, 0, SETTINGS)
    assert pod["spec"]["priorityClassName"] == "high"
    assert pod["spec"]["nodeSelector"] == {"pool": "a", "nvidia.com/gpu.product": "NVIDIA-H100"}
    # the user's, then the one ExtendedResourceToleration adds to GPU pods (carried explicitly)
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                                          {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


@pytest.mark.parametrize("gang,api,pod_key,where,scheduler", [
    ("coscheduling", "scheduling.x-k8s.io/v1alpha1", "scheduling.x-k8s.io/pod-group", "labels",
     "scheduler-plugins-scheduler"),
    ("volcano", "scheduling.volcano.sh/v1beta1", "scheduling.k8s.io/group-name", "annotations", "volcano"),
    ("kai", "scheduling.run.ai/v2alpha2", "pod-group-name", "annotations", "kai-scheduler"),
])
def test_external_gang_podgroups(gang, api, pod_key, where, scheduler):
    queue = None if gang == "coscheduling" else "research"  # coscheduling has no queues
    j = job(replicas=4, scheduling={"gang": gang, "queue": queue, "priorityClassName": "p"})
    g = m.build_gang(j, OWNER, 2, SETTINGS, None)
    pg = g.podgroup
    assert pg["apiVersion"] == api and pg["kind"] == "PodGroup" and pg["metadata"]["name"] == "gpt-2"
    assert pg["spec"]["minMember"] == 4 and pg["spec"].get("queue") == queue
    assert pg["metadata"]["ownerReferences"][0]["uid"] == "1234-abcd"
    for pod in g.pods:
        assert pod["metadata"][where][pod_key] == "gpt-2"
        assert pod["spec"]["schedulerName"] == scheduler
        assert "affinity" not in pod["spec"]  # the external scheduler places the gang
    if gang in ("volcano", "coscheduling"):
        assert pg["spec"]["minResources"] == {"cpu": "8", "memory": "12Gi"}
    if gang == "volcano":
        assert pg["spec"]["priorityClassName"] == "p"
        assert g.pods[0]["metadata"]["annotations"]["scheduling.volcano.sh/queue-name"] == "research"
    if gang == "kai":
        assert g.pods[0]["metadata"]["labels"]["kai.scheduler/queue"] == "research"
        assert "ownerReferences" not in g.pods[0]["metadata"]  # else KAI's pod grouper regroups them (gangs/kai.py)


def test_kueue_plain_pod_group_labels():
    g = m.build_gang(job(replicas=3, scheduling={"gang": "kueue", "queue": "team-a"}), OWNER, 1, SETTINGS, None)
    assert g.podgroup is None
    for pod in g.pods:
        md = pod["metadata"]
        assert md["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert md["labels"]["kueue.x-k8s.io/pod-group-name"] == "gpt-1234abcd"  # one group for every attempt
        assert md["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
        assert "schedulerName" not in pod["spec"]


def test_objects_pass_kubernetes_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    plain = m.build_gang(job(), OWNER, 1, SETTINGS, plan("a", "b"))
    multi = m.build_gang(job(resources={"gpus": 2}, scheduling={
        "tolerations": [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute",
                         "tolerationSeconds": 30}]}), OWNER, 1, SETTINGS, None)
    for obj in (plain.configmap, *plain.pods, *multi.pods, m.build_service(OWNER, SETTINGS), m.build_pdb(OWNER)):
        kubernetes_validate.validate(obj, "1.33", strict=True)


@pytest.mark.parametrize("name", ["7b-llama", "0", "-x", "x-", "X", "a" * 51, "a.b"])
def test_names_that_cannot_start_are_refused_at_validation_naming_the_field(name: str) -> None:
    from seqtrain.spec import SpecError, parse_job

    with pytest.raises(SpecError) as err:
        parse_job({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": name}})
    assert any(str(p).startswith("metadata.name") for p in err.value.problems), err.value.problems


@pytest.mark.parametrize("replicas", [1, 7, 4096])
def test_every_generated_name_is_valid_for_the_longest_valid_job_name(replicas: int) -> None:
    """Valid by construction: the longest name that validates yields Kubernetes-valid names for every object."""
    from seqtrain.spec import parse_job
    from seqtrain.spec.names import DNS1035_LABEL, DNS1123_LABEL, DNS1123_SUBDOMAIN, MAX_JOB_NAME

    name = "j" + "7" * (MAX_JOB_NAME - 1)
    job = parse_job({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": name},
                     "spec": {"replicas": replicas, "training": {"globalBatchSize": 8 * replicas}}})
    owner = Owner(name=name, namespace="ns", uid="u")
    svc = m.build_service(owner, m.Settings())
    assert DNS1035_LABEL.match(svc["metadata"]["name"]) and len(svc["metadata"]["name"]) <= 63
    gang = m.build_gang(job, owner, 999_999, m.Settings(), None)
    for obj in (gang.configmap, *gang.pods):
        assert DNS1123_SUBDOMAIN.match(obj["metadata"]["name"]) and len(obj["metadata"]["name"]) <= 253
        for value in obj["metadata"]["labels"].values():
            assert len(value) <= 63
    for pod in gang.pods:
        host = pod["spec"]["hostname"]
        assert DNS1123_LABEL.match(host) and len(host) <= 63


def test_disruption_opt_ins_annotate_the_pods_and_budget_the_gang():
    plain = m.build_gang(job(), OWNER, 1, SETTINGS, None).pods[0]
    assert m.DO_NOT_DISRUPT not in (plain["metadata"].get("annotations") or {})
    kept = m.build_gang(job(scheduling={"doNotDisrupt": True}), OWNER, 1, SETTINGS, None).pods[0]
    assert kept["metadata"]["annotations"][m.DO_NOT_DISRUPT] == "true"
    assert kept["metadata"]["annotations"][m.SAFE_TO_EVICT] == "false"
    pdb = m.build_pdb(OWNER)
    assert pdb["spec"] == {"maxUnavailable": 0, "selector": {"matchLabels": {
        m.LABEL_JOB: "gpt", m.LABEL_MANAGED: m.MANAGER, m.LABEL_UID: "1234-abcd"}}}
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "1234-abcd"
