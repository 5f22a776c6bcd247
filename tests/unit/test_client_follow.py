"""seqtrain_operator.client.follow: which pod logs `seqtrain logs` opens, pass by pass, against pod sequences a
gang goes through (first start, in-place restart, re-creation, a broken stream, deletion)."""

from __future__ import annotations

import pytest

from seqtrain_operator.client.follow import Follower, PodView, Selection, rank_prefix


def pod(attempt: int, replica: int, state: str = "running") -> PodView:
    return PodView(f"job-{attempt}-{replica}", f"uid-{attempt}-{replica}", attempt, replica, state)  # type: ignore[arg-type]


def follower(follow: bool = True, procs: int = 1, **sel: object) -> Follower:
    return Follower(Selection(**sel), follow, lambda r: tuple(range(r * procs, r * procs + procs)))  # type: ignore[arg-type]


def names(todo: list) -> list[str]:
    return [o.pod.name for o in todo]


@pytest.mark.parametrize(("ranks", "want"), [
    ((0,), "[rank 0] "), ((3, 2), "[ranks 2-3] "), ((0, 2), "[ranks 0,2] "), ((), "[rank ?] "),
])
def test_rank_prefix(ranks: tuple[int, ...], want: str) -> None:
    assert rank_prefix(ranks) == want


def test_rank_zero_is_followed_through_an_in_place_restart_until_the_job_ends() -> None:
    f = follower()
    todo, done = f.plan([pod(1, 0, "waiting"), pod(1, 1, "waiting")], "Running", 1)
    assert todo == [] and not done  # nothing started yet: wait, do not open
    todo, done = f.plan([pod(1, 0), pod(1, 1)], "Running", 1)
    assert names(todo) == ["job-1-0"] and todo[0].prefix == "[rank 0] " and not done
    f.line("uid-1-0")
    # ranks restarted in place: same pods, same stream; the job goes Restarting and Running again
    for phase in ("Restarting", "Running"):
        todo, done = f.plan([pod(1, 0), pod(1, 1)], phase, 1)
        assert todo == [] and not done
    todo, done = f.plan([pod(1, 0, "terminated"), pod(1, 1, "terminated")], "Succeeded", 1)
    assert todo == [] and not done  # the stream is still open: its last lines may be in flight
    f.closed("uid-1-0")
    assert f.plan([pod(1, 0, "terminated")], "Succeeded", 1) == ([], True)


def test_a_re_created_gang_is_followed_into_its_new_pods_with_a_marker_line() -> None:
    f = follower()
    todo, _ = f.plan([pod(1, 0), pod(1, 1)], "Running", 1)
    assert f.announce(todo[0]) is None  # the first attempt shown needs no marker
    f.closed("uid-1-0")  # the pod failed and was deleted
    todo, done = f.plan([], "Restarting", 1)
    assert todo == [] and not done
    todo, done = f.plan([pod(2, 1, "waiting"), pod(2, 0)], "Running", 2)
    assert names(todo) == ["job-2-0"] and todo[0].skip == 0 and not done
    assert "attempt 2" in (f.announce(todo[0]) or "")
    f.closed("uid-2-0")
    assert f.plan([pod(2, 0, "terminated")], "Succeeded", 2) == ([], True)


def test_following_starts_at_the_latest_attempt_present() -> None:
    f = follower()
    todo, _ = f.plan([pod(1, 0, "terminated"), pod(2, 0)], "Running", 2)
    assert names(todo) == ["job-2-0"]


def test_a_stream_that_broke_off_is_reopened_past_the_lines_shown() -> None:
    f = follower()
    todo, _ = f.plan([pod(1, 0)], "Running", 1)
    for _ in range(5):
        f.line("uid-1-0")
    f.closed("uid-1-0")  # connection dropped; the container runs on
    todo, done = f.plan([pod(1, 0)], "Running", 1)
    assert names(todo) == ["job-1-0"] and todo[0].skip == 5 and not done
    assert f.announce(todo[0]) is None


def test_a_stream_of_a_terminated_container_is_not_reopened() -> None:
    f = follower()
    f.plan([pod(1, 0)], "Running", 1)
    f.closed("uid-1-0")
    todo, done = f.plan([pod(1, 0, "terminated")], "Running", 1)
    assert todo == [] and not done  # the job goes on: a new attempt will come


def test_without_follow_each_chosen_log_is_read_once() -> None:
    f = follower(follow=False)
    todo, done = f.plan([pod(1, 0, "terminated"), pod(2, 0), pod(2, 1)], "Running", 2)
    assert names(todo) == ["job-2-0"] and not done
    f.line("uid-2-0")
    f.closed("uid-2-0")
    assert f.plan([pod(2, 0), pod(2, 1)], "Running", 2) == ([], True)


def test_all_ranks_open_every_started_pod_with_its_ranks() -> None:
    f = follower(procs=2, all_ranks=True)
    todo, _ = f.plan([pod(1, 0), pod(1, 1, "waiting")], "Running", 1)
    assert [(o.pod.name, o.prefix) for o in todo] == [("job-1-0", "[ranks 0-1] ")]
    todo, _ = f.plan([pod(1, 0), pod(1, 1)], "Running", 1)
    assert [(o.pod.name, o.prefix) for o in todo] == [("job-1-1", "[ranks 2-3] ")]


def test_a_rank_selects_the_pod_of_its_replica() -> None:
    f = follower(procs=2, rank=3)
    todo, _ = f.plan([pod(1, 0), pod(1, 1)], "Running", 1)
    assert names(todo) == ["job-1-1"]


def test_one_attempt_only_and_done_once_a_later_attempt_runs() -> None:
    f = follower(attempt=1)
    todo, done = f.plan([pod(1, 0), pod(2, 0, "waiting")], "Running", 1)
    assert names(todo) == ["job-1-0"] and not done
    f.closed("uid-1-0")
    todo, done = f.plan([pod(2, 0)], "Running", 2)
    assert todo == [] and done


def test_a_deleted_job_ends_the_follow_once_its_streams_end() -> None:
    f = follower()
    f.plan([pod(1, 0)], "Running", 1)
    assert f.plan([pod(1, 0)], None, 1) == ([], False)
    f.closed("uid-1-0")
    assert f.plan([], None, 1) == ([], True)


def _pod(labels: dict[str, str], state: dict[str, object] | None, container: str = "trainer") -> object:
    from types import SimpleNamespace as NS

    st = NS(running=state.get("running"), terminated=state.get("terminated")) if state is not None else None
    return NS(metadata=NS(name="p", uid="u", labels=labels),
              status=NS(container_statuses=[NS(name=container, state=st)] if state is not None else None))


def test_pod_view_reads_the_operators_labels_and_the_trainer_containers_state() -> None:
    from seqtrain_operator.client.kube import pod_view

    labels = {"seqtrain.dev/job": "j", "seqtrain.dev/attempt": "2", "seqtrain.dev/replica": "1",
              "seqtrain.dev/job-uid": "job-uid"}
    assert pod_view(_pod(labels, {"running": True}), "job-uid") == PodView("p", "u", 2, 1, "running")
    assert pod_view(_pod(labels, {"terminated": True}), "job-uid").state == "terminated"  # type: ignore[union-attr]
    assert pod_view(_pod(labels, None), "job-uid").state == "waiting"  # type: ignore[union-attr]
    assert pod_view(_pod(labels, {"running": True}, "sidecar"), "job-uid").state == "waiting"  # type: ignore[union-attr]
    assert pod_view(_pod(labels, {"running": True}), "another-uid") is None  # a deleted namesake's pod
    assert pod_view(_pod({"seqtrain.dev/job": "j"}, {"running": True}), "job-uid") is None
