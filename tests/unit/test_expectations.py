"""A cache that lags the API never makes the operator re-create a gang it created (k8s/cache/expect.py): the CI-red case
of test_operator_restart_mid_job_loses_nothing_duplicates_nothing, where a pass after the operator's restart ran
before kopf's pod index showed the gang it had just created and re-POSTed it (answered 409)."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_admission_lock import NODE, _job

from seqtrain_operator.k8s.passes import reconcile
from seqtrain_operator.k8s.process.runtime import Runtime
from seqtrain_operator.k8s.settings import Settings


@dataclass
class Api:
    """The API server as the operator calls it: jobs' status writes stick, pods exist once POSTed."""

    body: dict[str, Any]
    pods: dict[str, dict] = field(default_factory=dict)
    posts: list[str] = field(default_factory=list)  # every pod POST, 409s included
    lists: list[str] = field(default_factory=list)

    async def get_job(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.body)

    async def write_status(self, namespace: str, name: str, patch: dict, rv: str) -> dict[str, Any]:
        assert rv == self.body["metadata"]["resourceVersion"]
        status = self.body.setdefault("status", {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        self.body["metadata"]["resourceVersion"] = str(int(rv) + 1)
        return {"metadata": {"resourceVersion": self.body["metadata"]["resourceVersion"]}}

    async def create(self, obj: dict[str, Any]) -> bool:
        if obj["kind"] != "Pod":
            return True
        self.posts.append(obj["metadata"]["name"])
        if obj["metadata"]["name"] in self.pods:
            return False  # 409 AlreadyExists
        self.pods[obj["metadata"]["name"]] = obj
        return True

    async def list_pods(self, namespace: str | None, label_selector: str = "", field_selector: str = "") -> list:
        self.lists.append(label_selector)
        if label_selector.startswith("!"):
            return []  # no other tenants
        want = dict(term.split("=") for term in label_selector.split(",") if term)
        return [p for p in self.pods.values()
                if all(p["metadata"]["labels"].get(k) == v for k, v in want.items())]


class LaggingIndex:
    """kopf's indexes before the pod watch delivered anything of this job's gang."""

    def pods(self, namespace: str, job: str) -> list[dict]:
        return []

    def all_pods(self) -> list[dict]:
        return []

    def nodes(self) -> list[dict]:
        return [NODE]


def _operator(api: Api) -> reconcile.Reconciler:
    """A fresh operator: nothing in memory."""
    return reconcile.Reconciler(api, Settings(poll_progress=False))  # type: ignore[arg-type]


def _pass(api: Api, r: reconcile.Reconciler, monkeypatch: pytest.MonkeyPatch) -> reconcile.Outcome:
    monkeypatch.setattr(r, "lock", asyncio.Lock())  # an asyncio lock is bound to one event loop
    return asyncio.run(r.reconcile("ml", "j", lambda *a: None, LaggingIndex()))


@pytest.fixture
def api() -> Api:
    a = Api(_job("j"))
    a.body["spec"]["replicas"] = 2
    a.body["spec"]["resources"]["cpu"] = "500m"
    a.body["spec"]["training"]["globalBatchSize"] = 8
    return a


def test_passes_before_the_index_shows_the_gang_post_nothing_again(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _operator(api)
    _pass(api, cfg, monkeypatch)
    assert sorted(api.posts) == ["j-1-0", "j-1-1"] and api.body["status"]["attempt"] == 1
    lists = len(api.lists)
    for _ in range(3):  # woken again and again (node changes, the requeue) while the index still lags
        _pass(api, cfg, monkeypatch)
    assert sorted(api.posts) == ["j-1-0", "j-1-1"]  # never re-POSTed (the old code POSTed both again: 409s)
    assert api.body["status"]["attempt"] == 1
    assert len(api.lists) == lists  # nor planned again: no capacity read for a gang that exists


def test_a_restarted_operator_lists_the_attempt_before_re_creating_and_creates_only_what_is_absent(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    _pass(api, _operator(api), monkeypatch)
    del api.pods["j-1-1"]  # deleted while no operator ran (its DELETED event is lost with the old operator)
    _pass(api, _operator(api), monkeypatch)  # a fresh operator: nothing in memory, index lagging
    assert sorted(api.posts) == ["j-1-0", "j-1-1", "j-1-1"]  # only the absent pod, once
    assert "seqtrain.dev/job=j,seqtrain.dev/attempt=1" in api.lists
    assert api.body["status"]["attempt"] == 1


def test_a_pod_deleted_before_the_index_showed_it_is_created_again(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _operator(api)
    _pass(api, cfg, monkeypatch)
    rt = Runtime(reconciler=cfg)
    for name in ("j-1-0", "j-1-1"):  # deleted by someone; the DELETED events arrive (Runtime.pod_deleted)
        rt.pod_deleted(api.pods.pop(name))
    _pass(api, cfg, monkeypatch)
    assert sorted(api.posts) == ["j-1-0", "j-1-0", "j-1-1", "j-1-1"]
    assert sorted(api.pods) == ["j-1-0", "j-1-1"]
