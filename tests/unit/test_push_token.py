"""The progress push token worth the name (issue 35, outcome 5): bound to the job's uid and attempt
(k8s/pods/pushauth.py), delivered as a file from a per-attempt Secret the job owns (k8s/pods/manifests.py), never in
the pod spec or env; the operator's store (k8s/progress/push.py) refuses a deleted job's token, keeps entries by uid so
no token can displace a re-created namesake's progress, and ignores older or replayed documents by their sequence
number."""

from __future__ import annotations

import json

import pytest

from jobs import make_job
from seqtrain.spec import SeqTrainJob
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.k8s.pods.pushauth import (
    TOKEN_DIR,
    TOKEN_FILE,
    TOKEN_FILE_ENV,
    job_token,
    secret_name,
    valid_token,
)
from seqtrain_operator.k8s.progress.push import PushedProgress

KEY = b"k" * 32


def doc(step: int, attempt: int = 1) -> bytes:
    return json.dumps({"step": step, "totalSteps": 10, "attempt": attempt,
                       "updatedAt": "2026-01-01T00:00:00Z"}).encode()


def push(store: PushedProgress, uid: str = "u1", attempt: int = 1, seq: str | None = "1", step: int = 5,
         now: float = 100.0, name: str = "gpt", body: bytes | None = None) -> int:
    token = job_token(KEY, "ml", name, uid, attempt)
    return store.accept(KEY, "ml", name, uid, attempt, f"Bearer {token}", seq,
                        doc(step, attempt) if body is None else body, now=now)[0]


# ---- the token --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("ns", "name", "uid", "attempt", "ok"), [
    ("ml", "gpt", "u1", 1, True),
    ("ml", "gpt", "u1", 2, False),  # another attempt of the same job
    ("ml", "gpt", "u2", 1, False),  # a re-created job of the same name
    ("ml", "bert", "u1", 1, False),
    ("other", "gpt", "u1", 1, False),
])
def test_a_token_is_bound_to_namespace_job_uid_and_attempt(ns, name, uid, attempt, ok):
    token = job_token(KEY, "ml", "gpt", "u1", 1)
    assert valid_token(KEY, ns, name, uid, attempt, token) == ok
    assert not valid_token(b"", "ml", "gpt", "u1", 1, token)
    assert not valid_token(b"x" * 32, "ml", "gpt", "u1", 1, token)


# ---- the store: uid, attempt, sequence --------------------------------------------------------------------------

def test_a_deleted_jobs_token_is_refused_and_never_displaces_its_re_created_namesake():
    store = PushedProgress()
    assert push(store, "u1", step=5) == 204
    assert store.fresh("ml", "gpt", "u1", 30, attempt=1, now=100.0).progress.step == 5
    store.forget("u1")  # the job is deleted
    assert push(store, "u1", seq="2", step=6) == 403
    assert store.fresh("ml", "gpt", "u1", 30, now=100.0) is None
    # re-created under the same name: its own uid, its own entry
    assert store.fresh("ml", "gpt", "u2", 30, attempt=1, now=100.0) is None
    assert push(store, "u2", step=1) == 204
    assert push(store, "u1", seq="99", step=9) == 403  # the old job's token, with a higher sequence too
    assert store.fresh("ml", "gpt", "u2", 30, attempt=1, now=100.0).progress.step == 1


def test_forgetting_a_deleted_job_late_leaves_its_re_created_namesakes_entry():
    """The deletion of the old incarnation is handled after the new one's first pass and push (kopf's deletion
    handler runs late under load): forgetting by uid drops the old one only."""
    store = PushedProgress()
    assert push(store, "u1", step=5) == 204
    assert store.fresh("ml", "gpt", "u1", 30, attempt=1, now=100.0) is not None
    assert store.fresh("ml", "gpt", "u2", 30, attempt=1, now=100.0) is None  # a pass saw the namesake
    assert push(store, "u2", step=1) == 204
    store.forget("u1")
    assert store.fresh("ml", "gpt", "u2", 30, attempt=1, now=100.0).progress.step == 1
    assert push(store, "u2", seq="2", step=2) == 204  # its tokens still count
    assert push(store, "u1", seq="9", step=9) == 403


def test_after_an_operator_restart_an_old_incarnations_push_lands_in_its_own_entry_only():
    store = PushedProgress()  # a fresh operator: no pass has seen the job yet
    assert push(store, "u-old", step=9) == 204  # a deleted job's pod, still running somewhere
    assert push(store, "u-new", step=2) == 204
    assert store.fresh("ml", "gpt", "u-new", 30, attempt=1, now=100.0).progress.step == 2
    assert push(store, "u-old", seq="2", step=9) == 403  # the pass named the live uid: the other one is over
    assert store.fresh("ml", "gpt", "u-new", 30, attempt=1, now=100.0).progress.step == 2
    assert "u-old" not in store.jobs


def test_a_token_of_an_earlier_attempt_is_refused_once_a_pass_saw_the_next():
    store = PushedProgress()
    assert push(store, attempt=1, seq="50") == 204
    store.fresh("ml", "gpt", "u1", 30, attempt=2, now=100.0)  # the gang was restarted
    assert push(store, attempt=1, seq="51") == 403  # the dying gang's rank 0
    assert push(store, attempt=2, seq="1") == 204  # a new attempt starts its own sequence
    assert store.fresh("ml", "gpt", "u1", 30, attempt=2, now=100.0).progress.attempt == 2


def test_an_older_or_replayed_document_is_ignored_and_never_refreshes_the_entry():
    store = PushedProgress()
    assert push(store, seq="10", step=5, now=100.0) == 204
    assert push(store, seq="10", step=5, now=120.0) == 409  # replayed as it was
    assert push(store, seq="9", step=4, now=120.0) == 409  # an older document
    # the entry is still the one from t=100: at t=131 it is stale (the pass polls) instead of a fresh push of an
    # old step, which a pass would read as a hang
    assert store.fresh("ml", "gpt", "u1", 30, attempt=1, now=131.0) is None
    assert store.fresh("ml", "gpt", "u1", 30, attempt=1, now=129.0).progress.step == 5
    assert push(store, seq="11", step=6, now=130.0) == 204
    assert store.fresh("ml", "gpt", "u1", 30, attempt=1, now=131.0).progress.step == 6
    assert store.refused[409] == 2


@pytest.mark.parametrize("seq", [None, "", "abc", "0", "-1", "1.5", str(2**63), "9" * 40, " 7x"])
def test_a_push_without_a_valid_sequence_number_is_refused(seq):
    store = PushedProgress()
    assert push(store, seq=seq) == 400
    assert not store.jobs


def test_a_document_of_another_attempt_than_its_token_is_refused():
    store = PushedProgress()
    assert push(store, attempt=2, body=doc(5, attempt=1)) == 400


# ---- the Secret and the pod ------------------------------------------------------------------------------------

def _job() -> SeqTrainJob:
    return SeqTrainJob.model_validate(make_job("gpt", "ml", replicas=2,
                                               resources={"gpus": 0, "cpu": "1", "memory": "1Gi"}))


def test_each_attempts_token_is_a_secret_owned_by_the_job_and_mounted_never_in_the_pod_spec():
    owner = Owner(name="gpt", namespace="ml", uid="3f2a9c1e-0000-4000-8000-000000000001")
    settings = m.Settings(progress_push_url="http://op.seqtrain-system.svc:8472", push_key=KEY)
    gang = m.build_gang(_job(), owner, 3, settings, None)
    secret = gang.push_secret
    assert secret is not None and secret["kind"] == "Secret" and secret["immutable"] is True
    assert secret["metadata"]["name"] == secret_name("gpt", owner.uid, 3) == "gpt-push-3f2a9c1e-3"
    assert secret["metadata"]["ownerReferences"] == [owner.reference()]  # deleted with the job
    token = secret["stringData"]["token"]
    assert token == job_token(KEY, "ml", "gpt", owner.uid, 3)
    for pod in gang.pods:
        assert token not in json.dumps(pod) and KEY.decode() not in json.dumps(pod)
        c = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[TOKEN_FILE_ENV] == TOKEN_FILE and TOKEN_FILE.startswith(TOKEN_DIR + "/")
        (volume,) = [v for v in pod["spec"]["volumes"] if v.get("secret")]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert {"name": volume["name"], "mountPath": TOKEN_DIR, "readOnly": True} in c["volumeMounts"]
    # another attempt, another Secret and token; no push configured: no Secret, no volume
    assert m.build_gang(_job(), owner, 4, settings, None).push_secret["stringData"]["token"] != token
    off = m.build_gang(_job(), owner, 3, m.Settings(), None)
    assert off.push_secret is None
    assert not [v for p in off.pods for v in p["spec"]["volumes"] if v.get("secret")]
