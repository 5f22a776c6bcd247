"""The validating webhook handler (seqtrain_operator.k8s.process.handlers.validate), called as kopf calls it."""

from __future__ import annotations

import copy

import kopf
import pytest

from jobs import make_job
from seqtrain.spec import parse_job
from seqtrain_operator.k8s.process.handlers import validate
from seqtrain_operator.k8s.webhook.claims import claim_problem


def job(**spec: object) -> dict:
    return make_job("j", "ns", **spec)


BAD = job(replicas=0)  # stored before today's rules, or by an apiserver without the webhook


def test_create_and_spec_changes_are_validated_naming_the_field() -> None:
    with pytest.raises(kopf.AdmissionError, match="spec.replicas"):
        validate(BAD, operation="CREATE", old=None)
    with pytest.raises(kopf.AdmissionError, match="spec.replicas"):
        validate(BAD, operation="UPDATE", old=job(replicas=1))
    validate(job(replicas=2, training={"globalBatchSize": 16}), operation="UPDATE", old=job(replicas=1))


def test_updates_that_keep_the_spec_are_allowed_so_a_stored_invalid_job_can_lose_its_finalizer() -> None:
    new = copy.deepcopy(BAD)
    new["metadata"]["finalizers"] = []
    new["metadata"]["annotations"] = {"seqtrain.dev/last-handled-configuration": "{}"}
    validate(new, operation="UPDATE", old=BAD)


def test_updates_of_an_object_being_deleted_are_allowed() -> None:
    new = copy.deepcopy(BAD)
    new["metadata"]["deletionTimestamp"] = "2026-11-23T12:00:00Z"
    new["spec"]["replicas"] = -1
    validate(new, operation="UPDATE", old={**BAD, "metadata": new["metadata"]})


def test_a_checkpoint_claim_one_node_can_mount_is_refused_for_a_multi_node_gang() -> None:
    def claim(*modes: str, bound: tuple[str, ...] = ()) -> dict:
        return {"spec": {"accessModes": list(modes)}, "status": {"accessModes": list(bound)} if bound else {}}

    two = parse_job(job(replicas=2, training={"globalBatchSize": 16}, checkpoint={"pvc": "ck"}))
    one = parse_job(job(replicas=1, training={"globalBatchSize": 16}, checkpoint={"pvc": "ck"}))
    problem = claim_problem(two, claim("ReadWriteOnce"))
    assert problem is not None and problem.startswith("spec.checkpoint.pvc: claim ck is ReadWriteOnce")
    assert "ReadWriteMany" in problem and "replicas: 1" in problem
    assert claim_problem(two, claim("ReadWriteOncePod")) is not None
    assert claim_problem(two, claim("ReadWriteMany")) is None
    assert claim_problem(two, claim("ReadWriteOnce", bound=("ReadWriteOnce", "ReadWriteMany"))) is None
    assert claim_problem(one, claim("ReadWriteOnce")) is None
    assert claim_problem(two, None) is None  # not created yet: its pods wait for it


def test_the_kopf_floor_in_pyproject_is_the_one_the_code_documents() -> None:
    """pyproject.toml requires the kopf that handlers.KOPF_FLOOR explains: kopf's client honours Retry-After (its
    `enforce_retry_after` setting, new in 1.43.0), and enable_webhook's kopf.on.validate(operations=...) exists."""
    import inspect
    import re
    from pathlib import Path

    import tomllib

    from seqtrain_operator.k8s.process import handlers

    root = Path(__file__).resolve().parents[2]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["operator"]
    (kopf_req,) = [d for d in deps if re.match(r"kopf\b", d)]
    assert kopf_req == f"kopf>={handlers.KOPF_FLOOR}"
    assert hasattr(kopf.OperatorSettings().networking, "enforce_retry_after")
    assert "operations" in inspect.signature(kopf.on.validate).parameters
    assert "operations=" in inspect.getsource(handlers.enable_webhook)
