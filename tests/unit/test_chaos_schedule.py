"""The chaos soak's fault schedule (seqtrain_operator.chaos.schedule): seeded, rates respected, every kind reachable."""

from __future__ import annotations

import statistics

import pytest

from seqtrain_operator.chaos import schedule
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
    assert "nan-loss" in schedule.NOT_INJECTABLE
