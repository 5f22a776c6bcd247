"""One admission cycle for every waiting gang (planner/queue.py, k8s/capacity/admission.py): the order, the capacity
each plan leaves to the next, head-of-line reservation, and the shell that batches passes into cycles."""

from __future__ import annotations

import asyncio

from seqtrain_operator.k8s.capacity.admission import Admissions
from seqtrain_operator.planner.inventory import Requests
from seqtrain_operator.planner.queue import HEAD_OF_LINE_SECONDS, Waiting, admit, order, take
from seqtrain_operator.planner.types import Node

GPU = Requests(gpus=1, pods=1)


def gang(name: str, gpus: int, *, priority: int = 0, arrival: str = "2026-11-26T10:00:00Z", waited: float = 0.0,
         own: tuple[tuple[str, Requests], ...] = ()) -> Waiting[str]:
    """A gang of `gpus` one-GPU pods that fits only on one node (all or nothing, like a real plan)."""

    def plan(nodes: tuple[Node, ...] | None, blocked: str | None) -> tuple[str, list[tuple[str, Requests]]]:
        if nodes is None:
            return f"blocked: {blocked}", []
        fit = next((n for n in nodes if n.gpus >= gpus), None)
        return ("placed on " + fit.name, [(fit.name, GPU)] * gpus) if fit else ("no room", [])

    return Waiting(("ml", name), priority, arrival, waited, plan, own)


def nodes(*gpus: int) -> list[Node]:
    return [Node(f"n{i}", gpus=g, pods=110) for i, g in enumerate(gpus)]


def results(out: list) -> dict[str, str]:
    return {w.key[1]: decision for w, decision, _ in out}


def test_higher_priority_first_then_earlier_arrival() -> None:
    a = gang("a", 1, arrival="2026-11-26T10:00:02Z")
    b = gang("b", 1, arrival="2026-11-26T10:00:01Z")
    c = gang("c", 1, priority=100, arrival="2026-11-26T10:00:09Z")
    assert [w.key[1] for w in order([a, b, c])] == ["c", "b", "a"]
    got = results(admit(nodes(1, 1), [a, b, c]))  # two GPUs for three gangs: the latest of equal priority waits
    assert got == {"c": "placed on n0", "b": "placed on n1", "a": "no room"}


def test_each_plan_sees_what_the_ones_before_it_took() -> None:
    got = results(admit(nodes(4), [gang("a", 3), gang("b", 2, arrival="2026-11-26T10:00:01Z"),
                                   gang("c", 1, arrival="2026-11-26T10:00:02Z")]))
    assert got == {"a": "placed on n0", "b": "no room", "c": "placed on n0"}  # c backfills the GPU a left


def test_a_gang_waiting_past_the_head_of_line_time_is_not_starved_by_smaller_ones() -> None:
    big = gang("big", 4, waited=HEAD_OF_LINE_SECONDS + 1)
    small = gang("small", 1, arrival="2026-11-26T10:00:05Z")
    urgent = gang("urgent", 1, priority=10, arrival="2026-11-26T10:00:09Z")
    got = results(admit(nodes(2, 1), [big, small, urgent]))
    assert got["big"] == "no room" and got["urgent"] == "placed on n0"  # a higher priority still passes
    assert got["small"].startswith("blocked: waiting behind ml/big") and "head of the line" in got["small"]
    # before that time, the small one backfills
    early = results(admit(nodes(2, 1), [gang("big", 4, waited=5.0), small]))
    assert early == {"big": "no room", "small": "placed on n0"}


def test_a_gangs_own_going_pods_are_free_for_it_alone() -> None:
    mine = gang("mine", 2, own=(("n0", GPU), ("n0", GPU)))
    other = gang("other", 1, arrival="2026-11-26T10:00:01Z")
    got = results(admit(nodes(0), [mine, other]))
    assert got == {"mine": "placed on n0", "other": "no room"}


def test_take_and_give_back() -> None:
    n = nodes(4)
    assert take(n, [("n0", GPU)] * 3)[0].gpus == 1 and take(n, [("n0", GPU)], sign=-1)[0].gpus == 5
    assert take(n, [("elsewhere", GPU)]) == n


def test_the_shell_plans_every_waiting_pass_in_one_cycle_and_reserves_between_them() -> None:
    reserved: list[list[dict]] = []
    free_reads: list[int] = []

    def free() -> list[Node]:
        free_reads.append(1)
        return nodes(1)  # one GPU for the whole cycle

    def reserve(pods: list[dict]) -> list[tuple[str, str]]:
        reserved.append(pods)
        return [("ml", p["metadata"]["name"]) for p in pods]

    def plan_for(name: str):  # noqa: ANN202
        def plan(capacity: tuple[Node, ...] | None, blocked: str | None) -> tuple[str, list[dict]]:
            assert capacity is not None and blocked is None
            if capacity[0].gpus < 1:
                return "no room", []
            pod = {"metadata": {"name": f"{name}-0", "namespace": "ml"},
                   "spec": {"nodeName": "n0", "containers": [{"name": "t", "resources": {
                       "requests": {"nvidia.com/gpu": "1"}}}]}}
            return "placed", [pod]
        return plan

    async def main() -> list[tuple[str, list[tuple[str, str]]]]:
        adm = Admissions(free=free, reserve=reserve)
        try:
            return await asyncio.gather(*(adm.admit(("ml", n), 0, f"2026-11-26T10:00:0{i}Z", plan_for(n))
                                          for i, n in enumerate(("a", "b", "c"))))
        finally:
            assert adm.cycles == 1
            await adm.stop()

    out = asyncio.run(main())
    assert out == [("placed", [("ml", "a-0")]), ("no room", []), ("no room", [])]
    assert len(free_reads) == 1 and len(reserved) == 3 and reserved[0] and not reserved[1]


def test_a_cycle_waits_for_the_pass_of_a_waiting_gang_that_goes_before_its_own() -> None:
    # Found on the real control plane: a node added for two waiting gangs went to whichever pass reached the cycle
    # first (the lower priority: its pass had no PriorityClass to read), not to the higher priority.
    poked: list[tuple[str, str]] = []

    def plan(name: str):  # noqa: ANN202
        def p(capacity: tuple[Node, ...] | None, blocked: str | None) -> tuple[str, list[dict]]:
            if capacity is None or capacity[0].gpus < 1:
                return "no room", []
            return "placed", [{"metadata": {"name": f"{name}-0", "namespace": "ml"},
                               "spec": {"nodeName": "n0", "containers": [{"name": "t", "resources": {
                                   "requests": {"nvidia.com/gpu": "1"}}}]}}]
        return p

    room = [0]

    async def main() -> dict[str, str]:
        adm = Admissions(free=lambda: nodes(room[0]), reserve=lambda pods: [], poke=poked.append)
        try:
            # both wait: no room yet
            first = await asyncio.gather(adm.admit(("ml", "low"), 0, "2026-11-26T10:00:00Z", plan("low")),
                                         adm.admit(("ml", "high"), 100, "2026-11-26T10:00:05Z", plan("high")))
            assert [d for d, _ in first] == ["no room", "no room"] and set(adm.waiting) == {("ml", "low"), ("ml", "high")}
            room[0] = 1  # a node appears; the low one's pass comes first, the high one's a moment later
            low = asyncio.ensure_future(adm.admit(("ml", "low"), 0, "2026-11-26T10:00:00Z", plan("low")))
            await asyncio.sleep(0.05)
            assert poked == [("ml", "high")] and not low.done()  # the cycle asked the high one to join
            high = await adm.admit(("ml", "high"), 100, "2026-11-26T10:00:05Z", plan("high"))
            return {"low": (await low)[0], "high": high[0]}
        finally:
            await adm.stop()

    assert asyncio.run(main()) == {"low": "no room", "high": "placed"}
