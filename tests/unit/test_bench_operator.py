"""The pure parts of `seqtrain bench operator`: histogram quantiles and request classification."""

from __future__ import annotations

import pytest

from seqtrain_operator.benchmark import _minus, _resource, quantile

INF = float("inf")


def test_quantile_interpolates_within_the_bucket_like_histogram_quantile():
    b = [(0.01, 10.0), (0.1, 90.0), (1.0, 100.0), (INF, 100.0)]
    assert quantile(b, 0.5) == pytest.approx(0.055)  # rank 50 is half-way through the (0.01, 0.1] bucket
    assert quantile(b, 0.99) == pytest.approx(0.91)
    assert quantile(b, 0.05) == pytest.approx(0.005)
    assert quantile([(1.0, 0.0), (INF, 5.0)], 0.5) == 1.0  # past the largest finite bound: that bound
    assert quantile([(1.0, 0.0), (INF, 0.0)], 0.5) is None  # no observation


def test_steady_window_is_the_difference_of_two_scrapes():
    assert _minus([(0.1, 5.0), (INF, 9.0)], [(0.1, 2.0), (INF, 3.0)]) == [(0.1, 3.0), (INF, 6.0)]


@pytest.mark.parametrize("path, resource", [
    ("/api/v1/namespaces/x/pods/y/status", "pods/status"),
    ("/api/v1/namespaces/x/pods", "pods"),
    ("/api/v1/nodes", "nodes"),
    ("/apis/seqtrain.dev/v1alpha1/namespaces/x/seqtrainjobs/j", "seqtrainjobs"),
    ("/apis/kopf.dev/v1/clusterkopfpeerings/seqtrain", "clusterkopfpeerings"),
])
def test_requests_are_counted_by_resource(path, resource):
    assert _resource(path) == resource


def test_the_bare_and_kueue_gangs_are_the_operators_own_pods_without_an_owner():
    """The baseline and Kueue's side of the benchmark create the very pods the operator would (same requests and
    node selector), one list per gang, with no ownerReference that a garbage collector could act on."""
    from seqtrain_operator.benchmark import POOL, _bare_pods

    gangs = _bare_pods(3, 4, "ns", "k")
    assert [len(g) for g in gangs] == [4, 4, 4]
    assert [p["metadata"]["name"] for p in gangs[2]] == ["k00002-0", "k00002-1", "k00002-2", "k00002-3"]
    for pod in (p for g in gangs for p in g):
        assert "ownerReferences" not in pod["metadata"] and pod["metadata"]["labels"] == {}
        assert pod["spec"]["nodeSelector"][POOL] == "bench"
        assert pod["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}


def test_answer_times_are_per_kind_of_request_and_leave_out_watches_and_rare_kinds():
    from types import SimpleNamespace

    from seqtrain_operator.benchmark import answer_times

    def rec(method: str, path: str, took: float | None, watch: bool = False) -> SimpleNamespace:
        return SimpleNamespace(method=method, path=path, query="watch=true" if watch else "", watch=watch, at=10.0,
                               answered=None if took is None else 10.0 + took)

    patches = [rec("PATCH", "/apis/seqtrain.dev/v1alpha1/namespaces/a/seqtrainjobs/j/status", t / 100)
               for t in range(1, 101)]
    got = answer_times([*patches, rec("POST", "/api/v1/namespaces/a/pods", 0.5),
                        *[rec("GET", "/api/v1/pods", 60.0, watch=True)] * 200, rec("PATCH", patches[0].path, None)],
                       least=100)
    assert list(got) == ["PATCH seqtrainjobs/status"]  # one POST is too few to say anything; watches never answer
    assert got["PATCH seqtrainjobs/status"] == {"n": 100, "p50": 0.51, "p99": 1.0, "max": 1.0}


def test_a_busy_apiserver_is_asked_again_and_a_refusal_is_not() -> None:
    """The 1000-job run's progress probe once met a 504 from a busy apiserver and the whole run ended in a traceback:
    a 5xx, a 429 or a dropped connection is asked again; a 403 (say) still ends the run."""
    from kubernetes.client.exceptions import ApiException

    from seqtrain_operator import benchmark

    answers: list[Exception | bool] = [ApiException(status=504, reason="Timeout"), ApiException(status=429),
                                       ConnectionResetError(), True]

    def probe() -> bool:
        out = answers.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    assert benchmark._wait(probe, 10, "every job Running", interval=0) is True
    assert answers == []

    def refused() -> bool:
        raise ApiException(status=403, reason="Forbidden")

    with pytest.raises(ApiException):
        benchmark._wait(refused, 10, "every job Running", interval=0)
