"""Mesh rank arithmetic, stage splitting, bubble fraction and the engine x layout compatibility table."""

from __future__ import annotations

import itertools

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from seqtrain.layout.costs import stage_bounds
from seqtrain.layout.rules import engine_of, pipeline_micro_batches
from seqtrain.layout.topology import Coord, MeshShape, balanced_split, bubble_fraction
from seqtrain.spec import SpecError, apply_overrides, parse_job
from seqtrain.spec.resolve import resolved_model
from seqtrain_operator.planner.layout import rank_table, tp_groups_split_nodes
from seqtrain_operator.planner.local import local_plan

BASE = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: lay}
spec:
  model: {arch: gpt, preset: tiny}
  data: {seqLen: 32}
  training: {globalBatchSize: 8, microBatchSize: 2}
"""


def job(**sets: object):
    return parse_job(apply_overrides(yaml.safe_load(BASE), [f"{k}={v}" for k, v in sets.items()]),
                     check_features=False)


def problems(**sets: object) -> dict[str, str]:
    try:
        job(**sets)
    except SpecError as err:
        return {p.path: p.message for p in err.problems}
    return {}


def test_rank_order_tp_innermost_dp_outermost() -> None:
    mesh = MeshShape(dp=2, pp=2, tp=2)
    assert mesh.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.coord(5) == Coord(dp=1, pp=0, tp=1)


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_every_rank_is_in_exactly_one_group_of_each_kind(dp: int, pp: int, tp: int) -> None:
    mesh = MeshShape(dp=dp, pp=pp, tp=tp)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        groups = {"tp": mesh.tp_groups, "pp": mesh.pp_groups, "dp": mesh.dp_groups}[kind]()
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(mesh.world_size))
        assert all(len(g) == size for g in groups)
    for r in range(mesh.world_size):
        assert mesh.rank(mesh.coord(r)) == r


def test_tp_groups_stay_inside_a_replica() -> None:
    j = job(replicas=2, **{"resources.processesPerReplica": 2, "optimization.tensorParallel": 2})
    plan = local_plan(j)
    assert tp_groups_split_nodes(plan) == []
    table = rank_table(j, plan)
    for group in plan.layout and [[0, 1], [2, 3]]:
        assert len({table[r].replica for r in group}) == 1


def _brute_force(costs: list[float], parts: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@settings(max_examples=60)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=8), st.integers(1, 4))
def test_balanced_split_is_optimal_and_contiguous(costs: list[int], parts: int) -> None:
    if parts > len(costs):
        with pytest.raises(ValueError, match="at most"):
            balanced_split([float(c) for c in costs], parts)
        return
    bounds = balanced_split([float(c) for c in costs], parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
    assert max(sum(costs[a:b]) for a, b in bounds) == _brute_force([float(c) for c in costs], parts)


def test_heavy_lm_head_pulls_blocks_off_the_last_stage() -> None:
    # tiny GPT with a 32k vocabulary: the head outweighs a block, so the last stage gets fewer blocks.
    m = resolved_model(job(**{"model.vocabSize": 32768, "model.layers": 4}))
    assert stage_bounds(m, 2, 32) == [(0, 3), (3, 4)]
    even = resolved_model(job(**{"model.layers": 4}))
    assert stage_bounds(even, 2, 32) == [(0, 2), (2, 4)]


def test_bubble_fraction() -> None:
    assert bubble_fraction("gpipe", 1, 4) == 0
    assert bubble_fraction("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved", 4, 8, virtual_stages=2) == pytest.approx(3 / 19)


def test_default_pipeline_micro_batches_is_two_per_stage_when_it_divides() -> None:
    j = job(replicas=2, **{"optimization.pipelineParallel": 2})
    assert pipeline_micro_batches(j) == 4
    j6 = job(replicas=2, **{"optimization.pipelineParallel": 2, "training.globalBatchSize": 6})
    assert pipeline_micro_batches(j6) in (3, 6)


@pytest.mark.parametrize(
    ("sets", "engine"),
    [({}, "ddp"), ({"optimization.zero.stage": 3, "optimization.engine": "native"}, "fsdp2"),
     ({"optimization.zero.stage": 1}, "deepspeed"), ({"optimization.engine": "deepspeed"}, "deepspeed")],
)
def test_engine_choice(sets: dict, engine: str) -> None:
    assert engine_of(job(**sets)) == engine


# The compatibility table of docs/user-guide.md: (overrides, field expected in the error or None when valid).
TABLE = [
    ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
      "optimization.pipelineParallel": 2}, None),
    ({"replicas": 4, "optimization.zero.stage": 3, "optimization.engine": "native"}, None),
    ({"resources.processesPerReplica": 2, "optimization.zero.stage": 3, "optimization.engine": "native",
      "optimization.tensorParallel": 2}, None),
    ({"replicas": 2, "optimization.zero.stage": 3, "optimization.engine": "native",
      "optimization.pipelineParallel": 2}, "spec.optimization.pipelineParallel"),
    ({"replicas": 2, "optimization.zero.stage": 2}, None),
    ({"replicas": 2, "optimization.zero.stage": 3, "optimization.zero.offload": "cpu"}, None),
    ({"replicas": 2, "optimization.zero.stage": 2, "optimization.engine": "native"}, "spec.optimization.zero.stage"),
    ({"replicas": 2, "optimization.zero.offload": "cpu"}, "spec.optimization.zero.offload"),
    ({"resources.processesPerReplica": 2, "optimization.zero.stage": 1, "optimization.tensorParallel": 2},
     "spec.optimization.tensorParallel"),
    ({"replicas": 2, "optimization.zero.stage": 1, "optimization.pipelineParallel": 2},
     "spec.optimization.pipelineParallel"),
    ({"replicas": 2, "optimization.zero.stage": 1, "optimization.gradCompression": "bf16"},
     "spec.optimization.gradCompression"),
    ({"replicas": 2, "optimization.gradCompression": "fp16"}, None),
    ({"replicas": 2, "optimization.zero.stage": 2, "optimization.precision": "fp16"}, "spec.optimization.precision"),
    ({"replicas": 2, "optimization.zero.stage": 2, "optimization.precision": "bf16"}, None),
    ({"replicas": 2, "optimization.gradCompression": "bf16"}, "spec.optimization.gradCompression"),
    ({"replicas": 2, "resources.gpus": 1, "optimization.gradCompression": "bf16"}, None),
    ({"optimization.sequenceParallel": True}, "spec.optimization.sequenceParallel"),
    ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2, "optimization.sequenceParallel": True},
     None),
    ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
      "optimization.pipelineParallel": 2, "optimization.sequenceParallel": True}, None),
    ({"replicas": 2, "resources.processesPerReplica": 2, "optimization.zero.stage": 3, "optimization.engine": "native",
      "optimization.tensorParallel": 2, "optimization.sequenceParallel": True}, None),
    ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2, "optimization.sequenceParallel": True,
      "data.seqLen": 33}, "spec.data.seqLen"),
    # dropout on the replicated residual stream would draw different masks per tp rank
    ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2, "model.dropout": 0.1}, "spec.model.dropout"),
    ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2, "model.dropout": 0.1,
      "optimization.sequenceParallel": True}, None),
]


@pytest.mark.parametrize(("sets", "field"), TABLE)
def test_compatibility_table(sets: dict, field: str | None) -> None:
    got = problems(**sets)
    if field is None:
        assert got == {}
    else:
        assert field in got, got
        assert "use" in got[field]  # every message says what would work


@pytest.mark.parametrize(
    ("sets", "field", "hint"),
    [
        ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2, "model.vocabSize": 257},
         "spec.model.vocabSize", "258"),
        ({"resources.processesPerReplica": 3, "optimization.tensorParallel": 3, "training.microBatchSize": 8},
         "spec.model.heads", "multiple of 3"),
        ({"replicas": 2, "optimization.pipelineParallel": 2, "optimization.microBatches": 1},
         "spec.optimization.microBatches", "at least 2"),
        ({"replicas": 2, "optimization.pipelineParallel": 2, "optimization.microBatches": 3},
         "spec.optimization.microBatches", "divide"),
        ({"replicas": 4, "optimization.pipelineParallel": 4, "training.globalBatchSize": 2,
          "training.microBatchSize": 2}, "spec.training.globalBatchSize", "at least 4"),
        ({"replicas": 4, "optimization.pipelineParallel": 4}, "spec.optimization.pipelineParallel", "at most 2"),
        ({"model.arch": "lstm", "resources.processesPerReplica": 2, "optimization.tensorParallel": 2,
          "model.preset": "tiny"}, "spec.optimization.tensorParallel", "pipelineParallel"),
        ({"replicas": 2, "optimization.pipelineParallel": 2, "optimization.pipelineSchedule": "interleaved"},
         "spec.optimization.pipelineParallel", "at most 1"),
        ({"resources.processesPerReplica": 2, "optimization.tensorParallel": 2, "optimization.sequenceParallel": True,
          "data.seqLen": 33}, "spec.data.seqLen", "32 or 34"),
    ],
)
def test_parallel_traps_are_rejected_with_a_fix(sets: dict, field: str, hint: str) -> None:
    got = problems(**sets)
    assert field in got, got
    assert hint in got[field]


def test_interleaved_ranks_hold_two_chunks() -> None:
    j = job(replicas=2, **{"optimization.pipelineParallel": 2, "optimization.pipelineSchedule": "interleaved",
                           "model.layers": 4})
    table = rank_table(j, local_plan(j))
    assert [r.blocks for r in table] == [((0, 1), (2, 3)), ((1, 2), (3, 4))]
