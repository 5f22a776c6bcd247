"""The chaos soak's fault schedule (seqtrain_operator.chaos.schedule): seeded, rates respected, every kind reachable;
and the invariants it checks every round (seqtrain_operator.chaos.invariants), each shown to fire."""

from __future__ import annotations

import statistics

import pytest

from seqtrain_operator.chaos import schedule
from seqtrain_operator.chaos.invariants import Checker, Deadlines, stuck_after
from seqtrain_operator.chaos.schedule import KINDS, build, parse_rates


def test_same_seed_same_schedule_and_another_seed_another() -> None:
    a, b = build(7, 3600), build(7, 3600)
    assert a == b and len(a) > 0
    assert build(8, 3600) != a


def test_events_sorted_within_the_window_and_targets_match_the_kind() -> None:
    events = build(3, 1800, start_s=60)
    assert [e.at for e in events] == sorted(e.at for e in events)
    assert all(60 <= e.at < 1860 for e in events)
    assert all(e.target == KINDS[e.kind][0] for e in events)


def test_rates_respected_in_expectation() -> None:
    # 200 faults/hour over 10 hours: 2000 expected per kind; 40 seeds' means within 2% (sd of the mean ~0.2%).
    rates = {k: 200.0 for k in KINDS}
    counts: dict[str, list[int]] = {k: [] for k in KINDS}
    for seed in range(40):
        for k in KINDS:
            counts[k].append(0)
        for e in build(seed, 36000, rates):
            counts[e.kind][-1] += 1
    for k, c in counts.items():
        assert abs(statistics.mean(c) - 2000) < 40, (k, statistics.mean(c))


def test_every_kind_reachable_and_zero_switches_a_kind_off() -> None:
    kinds = {e.kind for e in build(1, 3600, {k: 30.0 for k in KINDS})}
    assert kinds == set(KINDS)
    off = build(1, 3600, {"sigkill-rank": 0})
    assert "sigkill-rank" not in {e.kind for e in off}


def test_one_kinds_rate_leaves_the_others_times_alone() -> None:
    base = [e for e in build(5, 3600) if e.kind != "api-5xx"]
    more = [e for e in build(5, 3600, {"api-5xx": 500}) if e.kind != "api-5xx"]
    assert base == more


def test_sigstop_draws_both_a_continue_and_a_hang() -> None:
    conts = {e.params["cont_after"] is None for e in build(2, 36000, {"sigstop-rank": 100}) if e.kind == "sigstop-rank"}
    assert conts == {True, False}


@pytest.mark.parametrize(("text", "words"), [
    ("sigkill-rank", "kind=faults-per-hour"),
    ("nosuch=3", "unknown fault kind 'nosuch'"),
    ("api-429=lots", "not a number"),
    ("api-429=-1", "negative"),
])
def test_bad_rates_say_what_to_fix(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_rates(text)


def test_rates_parse_and_unknown_kind_in_build_refused() -> None:
    assert parse_rates("sigkill-rank=30, api-5xx=0") == {"sigkill-rank": 30.0, "api-5xx": 0.0}
    with pytest.raises(ValueError, match="unknown fault kind"):
        build(1, 60, {"nan": 1})
    assert not schedule.NOT_INJECTABLE  # every kind the issue lists has an injector


# ---- the invariants the soak checks every round (seqtrain_operator.chaos.invariants) ----------------------------

SPEC = {"faultTolerance": {"backoffSeconds": 2, "maxBackoffSeconds": 20, "hangTimeoutSeconds": 120},
        "scheduling": {"pendingGraceSeconds": 300}}
D = Deadlines(termination_grace=30, node_lost_grace=40, check_interval=3)


def job(name: str, phase: str = "Running", step: int = 0, attempt: int = 1) -> dict:
    return {"metadata": {"name": name}, "status": {"phase": phase, "attempt": attempt, "progress": {"step": step}}}


def pod(name: str, job: str, replica: int, uid: str = "", deleting: bool = False, node: str = "cpu-0") -> dict:
    meta = {"name": name, "uid": uid or name, "labels": {"seqtrain.dev/job": job, "seqtrain.dev/replica": str(replica)}}
    if deleting:
        meta["deletionTimestamp"] = "now"
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": "Running"}}


def test_the_stuck_deadline_comes_from_the_jobs_settings() -> None:
    assert stuck_after(SPEC, 0, D) == 300 + 120 + 2 + 40 + 30 + 6
    assert stuck_after(SPEC, 10, D) == 300 + 120 + 20 + 40 + 30 + 6  # the backoff's cap


def test_a_job_without_change_past_its_deadline_is_stuck_once_and_a_fault_restarts_the_clock() -> None:
    c = Checker(D)
    c.add_job("a", "trainer", SPEC, 0)
    c.observe(1, [job("a", step=5)], [], {}, {}, set())
    c.fault("a", "sigkill-rank", 400)  # quiet time starts over
    c.observe(800, [job("a", step=5)], [], {}, {}, set())
    assert c.stuck == 0
    c.observe(400 + stuck_after(SPEC, 0, D) + 1, [job("a", step=5)], [], {}, {}, set())
    c.observe(2000, [job("a", step=5)], [], {}, {}, set())
    assert c.stuck == 1 and [v.what for v in c.violations] == ["stuck"]


def test_two_live_pods_of_one_replica_twice_in_a_row_are_duplicates() -> None:
    c = Checker(D)
    c.add_job("a", "trainer", SPEC, 0)
    pods = [pod("a-1-0", "a", 0), pod("a-2-0", "a", 0), pod("a-2-1", "a", 1)]
    c.observe(1, [job("a")], pods, {}, {}, set())
    assert c.duplicate_pods == 0  # once: maybe the moment between a delete and the list
    c.observe(4, [job("a")], pods, {}, {}, set())
    assert c.duplicate_pods == 1
    c.observe(7, [job("a")], [pods[0] | {"metadata": pods[0]["metadata"] | {"deletionTimestamp": "x"}}, *pods[1:]],
              {}, {}, set())
    assert c.duplicate_pods == 1


def test_a_pod_left_after_its_job_was_deleted_is_an_orphan_unless_its_node_is_down() -> None:
    c = Checker(D)
    c.add_job("a", "load", {}, 0)
    c.jobs["a"].deleted_at = 10
    c.observe(200, [], [pod("a-1-0", "a", 0, node="cpu-1")], {}, {}, {"cpu-1"})
    assert c.orphans == 0
    c.observe(203, [], [pod("a-1-0", "a", 0, node="cpu-1")], {}, {}, set())
    assert c.orphans == 1


def start(name: str, step: int | None) -> str:
    where = f"resumed from step {step}" if step is not None else "fresh start"
    return f"seqtrain: {name} attempt 2, {where}; gpt 0.12M params"


def test_a_start_older_than_the_newest_loadable_checkpoint_is_a_lost_checkpoint() -> None:
    c = Checker(D)
    c.add_job("a", "trainer", SPEC, 0)
    c.observe(1, [job("a")], [], {"a": {10, 20}}, {}, set())
    c.observe(4, [job("a")], [], {"a": {10, 20}}, {}, set())
    c.observe(7, [job("a")], [], {"a": {10, 20}}, {"a": [start("a", 20)]}, set())
    assert c.checkpoints_lost == 0
    c.observe(10, [job("a")], [], {"a": {10, 20}}, {"a": [start("a", 10)]}, set())
    c.observe(13, [job("a")], [], {"a": {10, 20}}, {"a": [start("a", None)]}, set())
    assert c.checkpoints_lost == 2
    assert [v.what for v in c.violations] == ["older checkpoint", "restart from scratch"]


def test_resuming_before_a_checkpoint_the_soak_corrupted_is_right() -> None:
    c = Checker(D)
    c.add_job("a", "trainer", SPEC, 0)
    for t in (1, 4):
        c.observe(t, [job("a")], [], {"a": {10, 20}}, {}, set())
    c.corrupted("a", 20)
    c.observe(7, [job("a")], [], {"a": {10, 20}}, {"a": [start("a", 10)]}, set())
    assert c.checkpoints_lost == 0 and not c.violations


def test_the_end_judges_failures_by_budget_and_losses_by_the_reference() -> None:
    c = Checker(D)
    for name in ("ok", "over", "early", "wrong"):
        c.add_job(name, "trainer", SPEC, 0)
    c.observe(1, [job("ok", "Succeeded"), {"metadata": {"name": "over"}, "status": {
        "phase": "Failed", "message": "replica 1 exit code 137 (killed by SIGKILL); 5 restarts"}},
        {"metadata": {"name": "early"}, "status": {"phase": "Failed", "message": "exit code 137"}},
        job("wrong", "Succeeded")], [], {}, {}, set())
    for _ in range(5):
        c.fault("over", "sigkill-rank", 1)
    c.fault("early", "sigkill-rank", 1)
    ref = {1: 5.0, 2: 4.5}
    c.finish(2, ref, {"ok": ({1: 5.0, 2: 4.5}, 0), "wrong": ({1: 5.0, 2: 4.6}, 0)},
             {n: (4, 20) for n in ("ok", "over", "early", "wrong")})
    assert sorted((v.job, v.what) for v in c.violations) == [("early", "unexpected failure"),
                                                            ("wrong", "wrong losses")]


def test_a_nan_loss_job_is_exact_up_to_its_nan_step_and_only_there() -> None:
    """A NaN loss skips its step's update: the steps before it must equal the reference, the ones after follow
    another trajectory; a job the nan-loss fault never hit is held to every step."""
    c = Checker(D)
    for name in ("nan", "nan-early-diff", "plain"):
        c.add_job(name, "trainer", SPEC, 0)
    c.observe(1, [job(n, "Succeeded") for n in ("nan", "nan-early-diff", "plain")], [], {}, {}, set())
    c.fault("nan", "nan-loss", 1)
    c.fault("nan-early-diff", "nan-loss", 1)
    ref = {1: 5.0, 2: 4.5, 3: 4.0, 4: 3.5}
    c.finish(2, ref, {"nan": ({1: 5.0, 2: 4.5, 3: None, 4: 3.9}, 0),
                      "nan-early-diff": ({1: 5.1, 2: 4.5, 3: None, 4: 3.9}, 0),
                      "plain": ({1: 5.0, 2: 4.5, 3: None, 4: 3.9}, 0)},
             {n: (4, 20) for n in ("nan", "nan-early-diff", "plain")})
    assert sorted((v.job, v.what) for v in c.violations) == [("nan-early-diff", "wrong losses"),
                                                            ("plain", "wrong losses")]
