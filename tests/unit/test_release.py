"""`seqtrain operator --release-finalizers` (the chart's uninstall hook): only the operator's finalizer goes, a
concurrent change of the list is re-read instead of overwritten, a job deleted meanwhile is fine."""

from __future__ import annotations

import copy

import pytest
from kubernetes.client.rest import ApiException

from seqtrain_operator.k8s.api.finalizers import FINALIZER, release_one


class Api:
    """A job store answering JSON patches the way the apiserver does (a failed `test` op: 422)."""

    def __init__(self, finalizers: list[str], change_once: str | None = None) -> None:
        self.stored = {"metadata": {"name": "j", "namespace": "ml", "finalizers": list(finalizers)}}
        self.change_once = change_once  # another client adds this finalizer right before our first patch
        self.patches = 0

    def patch_namespaced_custom_object(self, group, version, ns, plural, name, ops, _content_type):  # noqa: ANN001, ANN201
        assert _content_type == "application/json-patch+json"
        self.patches += 1
        fins = self.stored["metadata"]["finalizers"]
        if self.change_once:
            fins.insert(0, self.change_once)
            self.change_once = None
        test, remove = ops
        i = int(test["path"].rsplit("/", 1)[1])
        if i >= len(fins) or fins[i] != test["value"]:
            raise ApiException(status=422, reason="the test operation failed")
        del fins[int(remove["path"].rsplit("/", 1)[1])]

    def get_namespaced_custom_object(self, group, version, ns, plural, name):  # noqa: ANN001, ANN201
        return copy.deepcopy(self.stored)


def test_only_the_operators_finalizer_is_removed_and_a_concurrent_change_is_reread():
    api = Api(["example.com/keep", FINALIZER], change_once="other.io/new")
    assert release_one(api, copy.deepcopy(api.stored)) is True
    assert api.stored["metadata"]["finalizers"] == ["other.io/new", "example.com/keep"] and api.patches == 2
    assert release_one(api, copy.deepcopy(api.stored)) is False  # nothing of ours left: no patch
    assert api.patches == 2


def test_a_job_deleted_meanwhile_counts_as_released_by_nobody():
    api = Api([FINALIZER])

    def gone(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise ApiException(status=404, reason="Not Found")

    api.patch_namespaced_custom_object = gone  # type: ignore[method-assign]
    assert release_one(api, copy.deepcopy(api.stored)) is False


def test_other_api_errors_are_not_swallowed():
    api = Api([FINALIZER])

    def forbidden(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise ApiException(status=403, reason="Forbidden")

    api.patch_namespaced_custom_object = forbidden  # type: ignore[method-assign]
    with pytest.raises(ApiException):
        release_one(api, copy.deepcopy(api.stored))
