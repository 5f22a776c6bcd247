"""The Kubernetes API fake, checked against documented Kubernetes behaviour with the official Python client.

References: api-concepts ("Efficient detection of changes", 410 Gone; "Resource versions"), api-conventions
("Concurrency Control and Consistency": 409 on a stale resourceVersion; "Spec and Status": the status
subresource), the garbage collection docs (ownerReferences, cascading deletion, finalizers).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from k8sfake import Cluster, FakeKubernetes
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from seqtrain.spec.crd import crd as seqtrain_crd


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    with FakeKubernetes() as f:
        yield f


@pytest.fixture
def api(fake, tmp_path):
    path = fake.kubeconfig(str(tmp_path / "kubeconfig"))
    return config.new_client_from_config(config_file=path)


def cm(name, labels=None, owner=None):
    meta = {"name": name, "labels": labels or {}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"]}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": "v"}}


def _watch_lines(fake, path, n, timeout=5):
    with urllib.request.urlopen(f"{fake.url}{path}", timeout=timeout) as resp:
        return [json.loads(resp.readline()) for _ in range(n)]


def test_create_get_conflict_and_uid(api):
    core = client.CoreV1Api(api)
    created = core.create_namespaced_config_map("t1", cm("a"))
    assert created.metadata.uid and created.metadata.resource_version and created.metadata.creation_timestamp
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map("t1", cm("a"))
    assert err.value.status == 409 and json.loads(err.value.body)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as err:
        core.read_namespaced_config_map("missing", "t1")
    assert err.value.status == 404


def test_stale_resource_version_is_409_conflict(api):
    core = client.CoreV1Api(api)
    obj = core.create_namespaced_config_map("t2", cm("b"))
    stale = obj.metadata.resource_version
    obj.data = {"k": "new"}
    updated = core.replace_namespaced_config_map("b", "t2", obj)
    assert int(updated.metadata.resource_version) > int(stale)
    obj.metadata.resource_version = stale
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_config_map("b", "t2", obj)
    assert err.value.status == 409
    # the same precondition inside a merge patch
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_config_map("b", "t2", {"metadata": {"resourceVersion": stale}, "data": {"x": "1"}})
    assert err.value.status == 409


def test_label_and_field_selectors(api):
    core = client.CoreV1Api(api)
    for name, labels in (("c1", {"app": "x", "tier": "a"}), ("c2", {"app": "x"}), ("c3", {"app": "y"})):
        core.create_namespaced_config_map("t3", cm(name, labels))

    def names(**kw):
        return sorted(i.metadata.name for i in core.list_namespaced_config_map("t3", **kw).items)

    assert names(label_selector="app=x") == ["c1", "c2"]
    assert names(label_selector="app!=x") == ["c3"]
    assert names(label_selector="app in (x, y),!tier") == ["c2", "c3"]
    assert names(label_selector="tier") == ["c1"]
    assert names(label_selector="app notin (x)") == ["c3"]
    assert names(field_selector="metadata.name=c2") == ["c2"]


def test_status_subresource_is_separate(api, fake):
    Cluster(fake).install_crd(seqtrain_crd())
    co = client.CustomObjectsApi(api)
    body = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "j"},
            "spec": {"replicas": 1}, "status": {"phase": "Running"}}
    created = co.create_namespaced_custom_object("seqtrain.dev", "v1alpha1", "t4", "seqtrainjobs", body)
    assert created["status"] == {} and created["metadata"]["generation"] == 1  # status ignored on create
    co.patch_namespaced_custom_object("seqtrain.dev", "v1alpha1", "t4", "seqtrainjobs", "j",
                                      {"status": {"phase": "Failed"}})
    after = co.get_namespaced_custom_object("seqtrain.dev", "v1alpha1", "t4", "seqtrainjobs", "j")
    assert after["status"] == {}  # the main resource ignores status writes
    co.patch_namespaced_custom_object_status("seqtrain.dev", "v1alpha1", "t4", "seqtrainjobs", "j",
                                             {"status": {"phase": "Running"}, "spec": {"replicas": 9}})
    after = co.get_namespaced_custom_object("seqtrain.dev", "v1alpha1", "t4", "seqtrainjobs", "j")
    assert after["status"] == {"phase": "Running"} and after["spec"]["replicas"] == 1
    assert after["metadata"]["generation"] == 1  # status writes never bump generation
    co.patch_namespaced_custom_object("seqtrain.dev", "v1alpha1", "t4", "seqtrainjobs", "j", {"spec": {"replicas": 2}})
    after = co.get_namespaced_custom_object("seqtrain.dev", "v1alpha1", "t4", "seqtrainjobs", "j")
    assert after["metadata"]["generation"] == 2


def test_finalizers_and_owner_cascade(api, fake):
    core = client.CoreV1Api(api)
    owner = core.create_namespaced_config_map("t5", {**cm("owner"), "metadata": {"name": "owner",
                                                                                  "finalizers": ["x/y"]}})
    owner_d = api.sanitize_for_serialization(owner)
    core.create_namespaced_config_map("t5", cm("child", owner=owner_d))
    grandchild_owner = api.sanitize_for_serialization(core.read_namespaced_config_map("child", "t5"))
    core.create_namespaced_config_map("t5", cm("grandchild", owner=grandchild_owner))
    core.create_namespaced_config_map("t5", cm("orphan-candidate"))
    core.delete_namespaced_config_map("owner", "t5")
    held = core.read_namespaced_config_map("owner", "t5")
    assert held.metadata.deletion_timestamp is not None  # a finalizer holds it
    assert len(core.list_namespaced_config_map("t5").items) == 4
    core.patch_namespaced_config_map("owner", "t5", {"metadata": {"finalizers": None}})
    left = sorted(i.metadata.name for i in core.list_namespaced_config_map("t5").items)
    assert left == ["orphan-candidate"]  # owner, child and grandchild are gone


def test_orphan_propagation_keeps_dependents(api):
    core = client.CoreV1Api(api)
    owner = api.sanitize_for_serialization(core.create_namespaced_config_map("t6", cm("o")))
    core.create_namespaced_config_map("t6", cm("d", owner=owner))
    core.delete_namespaced_config_map("o", "t6", body=client.V1DeleteOptions(propagation_policy="Orphan"))
    dep = core.read_namespaced_config_map("d", "t6")
    assert not dep.metadata.owner_references


def test_watch_resumes_from_resource_version_and_410_when_too_old(api, fake):
    core = client.CoreV1Api(api)
    listing = core.list_namespaced_config_map("t7")
    rv = listing.metadata.resource_version
    core.create_namespaced_config_map("t7", cm("w1"))
    core.patch_namespaced_config_map("w1", "t7", {"data": {"k": "2"}})
    core.delete_namespaced_config_map("w1", "t7")
    events = _watch_lines(fake, f"/api/v1/namespaces/t7/configmaps?watch=true&resourceVersion={rv}", 3)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    assert int(events[1]["object"]["metadata"]["resourceVersion"]) > int(events[0]["object"]["metadata"]["resourceVersion"])
    # history is bounded: a watch from before it is told 410 Gone, and clients must relist
    limit = fake.store.history_limit
    fake.store.history_limit = 2
    try:
        for i in range(4):
            core.create_namespaced_config_map("t7", cm(f"h{i}"))
        err = _watch_lines(fake, f"/api/v1/namespaces/t7/configmaps?watch=true&resourceVersion={rv}", 1)[0]
        assert err["type"] == "ERROR" and err["object"]["code"] == 410
    finally:
        fake.store.history_limit = limit


def test_watch_with_label_selector_and_initial_state(api, fake):
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map("t8", cm("keep", {"sel": "1"}))
    core.create_namespaced_config_map("t8", cm("skip", {"sel": "0"}))
    events = _watch_lines(fake, "/api/v1/namespaces/t8/configmaps?watch=1&labelSelector=sel%3D1", 1)
    assert events[0]["type"] == "ADDED" and events[0]["object"]["metadata"]["name"] == "keep"


def test_injected_faults(api, fake):
    core = client.CoreV1Api(api)
    fake.inject("POST", r"/namespaces/t9/configmaps$", status=500, times=1)
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map("t9", cm("f"))
    assert err.value.status == 500
    assert core.create_namespaced_config_map("t9", cm("f")).metadata.name == "f"  # only once
    slow = fake.inject("GET", r"/namespaces/t9/configmaps/f$", delay=0.5, times=-1)
    with pytest.raises(Exception):  # noqa: B017 - urllib3's ReadTimeoutError, wrapped differently per version
        core.read_namespaced_config_map("f", "t9", _request_timeout=0.1)
    fake.faults.remove(slow)
    assert core.read_namespaced_config_map("f", "t9").metadata.name == "f"
    assert fake.count("POST", r"/namespaces/t9/configmaps$", status=500) == 1


def test_discovery_lists_crd_resources_with_status(fake):
    Cluster(fake).install_simple_crd("example.com", "widgets", "Widget")
    with urllib.request.urlopen(f"{fake.url}/apis/example.com/v1", timeout=5) as resp:
        doc = json.load(resp)
    names = {r["name"] for r in doc["resources"]}
    assert names == {"widgets", "widgets/status"}
    with urllib.request.urlopen(f"{fake.url}/apis", timeout=5) as resp:
        groups = {g["name"] for g in json.load(resp)["groups"]}
    assert {"example.com", "apiextensions.k8s.io", "coordination.k8s.io"} <= groups
