"""spec.podTemplate: merged over the generated pod with the documented precedence; owned fields refused by name."""

from __future__ import annotations

import pytest

from jobs import make_job
from seqtrain.spec import SpecError, parse_job
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.planner.types import Layout, Plan, ReplicaAssignment

OWNER = Owner(name="gpt", namespace="ml", uid="1234-abcd")

RDMA_TEMPLATE = {
    "metadata": {"labels": {"team": "nlp"}, "annotations": {"example.com/cost-center": "42"}},
    "spec": {
        "serviceAccountName": "trainer-sa",
        "containers": [
            {"name": "trainer",
             "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}, {"name": "HOME", "value": "/home/me"}],
             "envFrom": [{"secretRef": {"name": "hf-token"}}],
             "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
             "resources": {"limits": {"rdma/ib": "1"}},
             "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}},
            {"name": "log-shipper", "image": "fluent/fluent-bit:3.0",
             "volumeMounts": [{"name": "checkpoints", "mountPath": "/logs", "readOnly": True}]},
        ],
        "initContainers": [{"name": "fetch", "image": "busybox:1.36", "command": ["true"]}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
        "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "network", "operator": "In", "values": ["ib"]}]},
                {"matchExpressions": [{"key": "network", "operator": "In", "values": ["roce"]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "preference": {"matchExpressions": [
                    {"key": "spot", "operator": "DoesNotExist"}]}}]}},
    },
}


def doc(template, **spec):
    return make_job("gpt", **{"replicas": 2, "resources": {"cpu": "1", "memory": "1Gi"},
                              "training": {"globalBatchSize": 16}, "podTemplate": template, **spec})


def pod(template, node="node-a", **spec):
    job = parse_job(doc(template, **spec))
    plan = Plan(world_size=2, procs_per_replica=1, layout=Layout(dp=2),
                replicas=(ReplicaAssignment(0, node, (0,)), ReplicaAssignment(1, node, (1,))))
    return m.build_gang(job, OWNER, 1, m.Settings(), plan if node else None).pods[1]


def problems(template, **spec):
    with pytest.raises(SpecError) as err:
        parse_job(doc(template, **spec))
    return {p.path: p.message for p in err.value.problems}


def test_overrides_are_merged_with_operator_fields_kept():
    p = pod(RDMA_TEMPLATE)
    meta, spec = p["metadata"], p["spec"]
    assert meta["labels"]["team"] == "nlp" and meta["labels"][m.LABEL_JOB] == "gpt"
    assert meta["annotations"]["example.com/cost-center"] == "42"
    assert spec["serviceAccountName"] == "trainer-sa"
    assert spec["automountServiceAccountToken"] is False  # unchanged unless the override asks
    (trainer,) = spec["containers"]  # the sidecar is a native one: it cannot keep the pod Running (below)
    assert trainer["name"] == "trainer"
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["NCCL_IB_HCA"] == "mlx5" and env["HOME"] == "/home/me"  # added; a default replaced
    assert env["RANK"] == "1" and env["MASTER_PORT"] == "29500"  # owned, untouched
    assert [e["name"] for e in trainer["env"]].count("HOME") == 1
    assert trainer["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    mounts = {v["mountPath"]: v["name"] for v in trainer["volumeMounts"]}
    assert mounts["/data"] == "data" and mounts["/checkpoints"] == "checkpoints"
    assert trainer["resources"]["requests"]["rdma/ib"] == "1" == trainer["resources"]["limits"]["rdma/ib"]
    assert trainer["resources"]["requests"]["cpu"] == "1"
    assert trainer["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert trainer["command"][:2] == ["seqtrain", "train"] and trainer["ports"][0]["containerPort"] == 29500
    fetch, sidecar = spec["initContainers"]  # the user's init containers run first, then the sidecars start
    assert fetch["name"] == "fetch" and "restartPolicy" not in fetch
    assert sidecar["name"] == "log-shipper" and sidecar["restartPolicy"] == "Always"
    assert [v["name"] for v in spec["volumes"]] == ["config", "dshm", "tmp", "checkpoints", "data"]
    # nodeAffinity: each user term ANDed with the operator's pin (Kubernetes ORs terms)
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2
    for term, net in zip(terms, ["ib", "roce"], strict=True):
        assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]
        assert term["matchExpressions"][0]["values"] == [net]
    assert spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 10


def test_affinity_without_an_operator_pin_is_the_users():
    p = pod(RDMA_TEMPLATE, node=None, scheduling={"gang": "coscheduling"})
    terms = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == RDMA_TEMPLATE["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_empty_template_changes_nothing():
    assert pod({}) == pod({"metadata": {}, "spec": {}})
    assert "initContainers" not in pod({})["spec"]


@pytest.mark.parametrize(("template", "path", "words"), [
    ({"metadata": {"labels": {"seqtrain.dev/job": "x"}}}, "spec.podTemplate.metadata.labels.seqtrain.dev/job",
     "selects its pods"),
    ({"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "q"}}},
     "spec.podTemplate.metadata.labels.kueue.x-k8s.io/queue-name", "scheduling.gang/queue"),
    ({"spec": {"containers": [{"name": "trainer", "env": [{"name": "RANK", "value": "0"}]}]}},
     "spec.podTemplate.spec.containers[0].env[0].name", "set by the operator"),
    ({"spec": {"containers": [{"name": "trainer", "env": [{"name": "SEQTRAIN_ATTEMPT", "value": "0"}]}]}},
     "spec.podTemplate.spec.containers[0].env[0].name", "rank and rendezvous"),
    ({"spec": {"containers": [{"name": "trainer", "image": "mine:1"}]}},
     "spec.podTemplate.spec.containers[0].image", "spec.image"),
    ({"spec": {"containers": [{"name": "trainer", "ports": [{"containerPort": 1}]}]}},
     "spec.podTemplate.spec.containers[0].ports", "owns the trainer's ports"),
    ({"spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "d", "mountPath": "/checkpoints"}]}],
               "volumes": [{"name": "d", "emptyDir": {}}]}},
     "spec.podTemplate.spec.containers[0].volumeMounts[0].mountPath", "overlaps the operator's mount /checkpoints"),
    ({"spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "d", "mountPath": "/"}]}],
               "volumes": [{"name": "d", "emptyDir": {}}]}},
     "spec.podTemplate.spec.containers[0].volumeMounts[0].mountPath", "overlaps"),
    ({"spec": {"volumes": [{"name": "checkpoints", "emptyDir": {}}]}}, "spec.podTemplate.spec.volumes[0].name",
     "operator's volumes"),
    ({"spec": {"containers": [{"name": "trainer", "resources": {"limits": {"memory": "9Gi"}}}]}},
     "spec.podTemplate.spec.containers[0].resources.limits.memory", "spec.resources"),
    ({"spec": {"containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}},
     "spec.podTemplate.spec.containers[0].resources.limits.nvidia.com/gpu", "spec.resources"),
    ({"spec": {"containers": [{"name": "trainer", "resources": {"requests": {"rdma/ib": "1"},
                                                                "limits": {"rdma/ib": "2"}}}]}},
     "spec.podTemplate.spec.containers[0].resources.limits.rdma/ib", "must be equal"),
    ({"spec": {"containers": [{"name": "trainer", "securityContext": {"runAsUser": 0}}]}},
     "spec.podTemplate.spec.containers[0].securityContext.runAsUser", "capabilities.add"),
    ({"spec": {"containers": [{"name": "trainer", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}},
     "spec.podTemplate.spec.containers[0].securityContext.capabilities.add[0]", "IPC_LOCK"),
    ({"spec": {"containers": [{"name": "side"}]}}, "spec.podTemplate.spec.containers[0].image", "required"),
    ({"spec": {"containers": [{"name": "side", "image": "x", "ports": [{"containerPort": 29500}]}]}},
     "spec.podTemplate.spec.containers[0].ports[0].containerPort", "rendezvous"),
    ({"spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "nope", "mountPath": "/data"}]}]}},
     "spec.podTemplate.spec.containers[trainer].volumeMounts", "does not declare"),
    ({"spec": {"initContainers": [{"name": "a", "image": "x"}, {"name": "a", "image": "y"}]}},
     "spec.podTemplate.spec.initContainers", "more than once"),
    ({"spec": {"affinity": {"nodeAfinity": {}}}}, "spec.podTemplate.spec.affinity.nodeAfinity", "unknown"),
])
def test_owned_or_broken_overrides_are_refused_with_the_field(template, path, words):
    found = problems(template)
    assert path in found, found
    assert words in found[path]


def test_unknown_pod_fields_are_listed():
    found = problems({"spec": {"hostNetwork": True}})
    assert "spec.podTemplate.spec.hostNetwork" in found
    assert "serviceAccountName" in found["spec.podTemplate.spec.hostNetwork"]


def test_sidecar_may_mount_the_checkpoint_volume_read_only():
    p = pod({"spec": {"containers": [{"name": "s", "image": "x",
                                      "volumeMounts": [{"name": "checkpoints", "mountPath": "/ck"}]}]}})
    assert p["spec"]["initContainers"][0]["volumeMounts"][0]["name"] == "checkpoints"


def test_a_fault_drill_env_var_reaches_the_trainer_though_other_seqtrain_vars_are_the_operators():
    drill = {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "SEQTRAIN_FAULT_KILL_AT_STEP", "value": "20:1"}, {"name": "SEQTRAIN_FAULT_ATTEMPT", "value": "1"}]}]}}
    env = {e["name"]: e.get("value") for e in pod(drill)["spec"]["containers"][0]["env"]}
    assert env["SEQTRAIN_FAULT_KILL_AT_STEP"] == "20:1" and env["SEQTRAIN_FAULT_ATTEMPT"] == "1"
    assert env["SEQTRAIN_ATTEMPT"] == "1"  # still the operator's


def test_the_push_token_volume_and_its_mount_are_the_operators():
    """The trainer mounts the per-attempt push token Secret as volume seqtrain-push-token at /var/run/seqtrain/push:
    a user's volume of that name would make the apiserver refuse every pod (duplicate name), a mount there would
    hide the token."""
    from seqtrain.spec.template import OWNED_MOUNT_PATHS, OWNED_VOLUMES
    from seqtrain_operator.k8s.pods.manifests import PUSH_VOLUME
    from seqtrain_operator.k8s.pods.pushauth import TOKEN_DIR

    assert PUSH_VOLUME in OWNED_VOLUMES
    assert any(p == TOKEN_DIR or TOKEN_DIR.startswith(p + "/") for p in OWNED_MOUNT_PATHS)
