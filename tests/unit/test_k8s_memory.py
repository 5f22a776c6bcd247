"""One JobMemory per job incarnation, keyed by uid (k8s/cache/memory.py), dropped by one forget(uid): a deleted job's
record is never read or dropped for a namesake created under the same name (the deletion handler of the old one may run
after the new one's first passes and pushes)."""

from __future__ import annotations

import asyncio
import copy

from test_admission_lock import Index, Kube, _job
from test_push_token import push

from seqtrain_operator.k8s.api.finalizers import FINALIZER
from seqtrain_operator.k8s.cache.memory import STALE, Jobs
from seqtrain_operator.k8s.passes.reconcile import Reconciler
from seqtrain_operator.k8s.process.runtime import Runtime
from seqtrain_operator.k8s.settings import Settings


def test_forgetting_a_deleted_job_leaves_its_re_created_namesakes_memory() -> None:
    jobs = Jobs()
    old = jobs.seen("ml", "gpt", "u1")
    old.known, old.boost = "41", 7
    new = jobs.seen("ml", "gpt", "u2")  # re-created before the old one's deletion was handled
    assert new is not old and new.known is None and new.boost is None  # nothing of the old one's
    assert jobs.get("ml", "gpt") is new
    assert jobs.forget("u1") is old
    assert jobs.get("ml", "gpt") is new and jobs.of_uid("u2") is new and jobs.of_uid("u1") is None
    assert jobs.forget("u2") is new and jobs.get("ml", "gpt") is None and len(jobs) == 0
    assert jobs.forget("u2") is None  # twice: nothing left to drop


def test_one_forget_drops_what_the_shared_objects_hold_for_that_incarnation_only() -> None:
    r = Reconciler(Kube(_job("gpt")))  # type: ignore[arg-type]
    r.jobs.seen("ml", "gpt", "u1")
    assert push(r.pushed, "u1", step=5) == 204
    r.pushed.fresh("ml", "gpt", "u1", 30, attempt=1, now=100.0)
    r.jobs.seen("ml", "gpt", "u2")  # the namesake: its first pass and push
    r.pushed.fresh("ml", "gpt", "u2", 30, attempt=1, now=100.0)
    assert push(r.pushed, "u2", step=1) == 204
    reserved = r.busy.reserve([{"metadata": {"name": "gpt-1-0", "namespace": "ml",
                                             "labels": {"seqtrain.dev/job": "gpt"}}}])
    r.forget("u1")
    assert r.jobs.get("ml", "gpt") is not None and r.jobs.get("ml", "gpt").uid == "u2"  # type: ignore[union-attr]
    assert r.pushed.fresh("ml", "gpt", "u2", 30, attempt=1, now=100.0).progress.step == 1  # type: ignore[union-attr]
    assert sorted(r.busy.reserved) == reserved  # the namesake's gang still holds its capacity
    r.forget("u2")
    assert r.jobs.get("ml", "gpt") is None and not r.busy.reserved
    assert push(r.pushed, "u2", seq="2", step=2) == 403  # a deleted job's token


def test_a_pass_of_a_re_created_namesake_reads_its_own_body_not_the_old_records() -> None:
    """The old incarnation's record says its last status write replaced version 1 and returned version 2 (attempt 4
    running); the namesake's live body is at version 1 too (another object's counter is no proof of anything). Its
    first pass must read its own body, not the old job's write, and leave the old record alone."""
    body = _job("gpt")
    body["metadata"].update(uid="u2", finalizers=[FINALIZER])  # kopf has settled it
    kube = Kube(body)
    r = Reconciler(kube, Settings(poll_progress=False))  # type: ignore[arg-type]
    old = r.jobs.seen("ml", "gpt", "u1")
    old_body = {**body, "metadata": {**body["metadata"], "uid": "u1", "resourceVersion": "2"},
                "status": {"phase": "Running", "attempt": 4}}
    old.known, old.written = "2", ("1", copy.deepcopy(old_body))
    new = r.jobs.seen("ml", "gpt", "u2")
    new.live = copy.deepcopy(body)  # its daemon's live body
    outcome = asyncio.run(r.reconcile("ml", "gpt", lambda *a: None, Index()))
    assert outcome.status is not None and outcome.status.attempt == 1  # its own first attempt, not attempt 4
    assert old.known == "2" and old.written is not None  # the old record is untouched until its own forget
    assert new.known not in (None, STALE)


def test_the_runtime_forgets_a_job_in_one_call() -> None:
    r = Reconciler(Kube(_job("gpt")))  # type: ignore[arg-type]
    rt = Runtime(reconciler=r)
    mem = rt.memory("ml", "gpt", "u1")
    mem.restarts, mem.boost = (1, 0), 3
    rt.forget("u1")
    assert r.jobs.get("ml", "gpt") is None and len(r.jobs) == 0
