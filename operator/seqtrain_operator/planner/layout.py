"""Who is who in the gang: each rank's replica, node, local rank, mesh coordinates and pipeline blocks.

The rank arithmetic itself (tensor parallel innermost, data parallel outermost) lives in
`seqtrain.layout.topology`, shared with the trainer so the plan shows exactly the groups it will build.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from seqtrain.layout.costs import stage_bounds
from seqtrain.layout.rules import pipeline_micro_batches
from seqtrain.layout.topology import INTERLEAVED_CHUNKS, MeshShape, bubble_fraction
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.resolve import resolved_model
from seqtrain_operator.planner.types import Layout, Plan


def mesh_of(layout: Layout) -> MeshShape:
    return MeshShape(dp=layout.dp, pp=layout.pp, tp=layout.tp)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    replica: int
    node: str
    local_rank: int
    dp: int
    pp: int
    tp: int
    blocks: tuple[tuple[int, int], ...]  # [start, end) ranges of model.blocks / model.layers on this rank

    def to_dict(self) -> dict:
        return asdict(self)


def rank_table(job: SeqTrainJob, plan: Plan) -> list[RankInfo]:
    mesh = mesh_of(plan.layout)
    pp = plan.layout.pp
    # interleaved 1F1B: each rank holds INTERLEAVED_CHUNKS model chunks, stages r, r + pp, ...
    v = INTERLEAVED_CHUNKS if pp > 1 and job.spec.optimization.pipeline_schedule == "interleaved" else 1
    bounds = stage_bounds(resolved_model(job), pp * v, job.spec.data.seq_len)
    out = []
    for rep in plan.replicas:
        for local, rank in enumerate(rep.ranks):
            c = mesh.coord(rank)
            out.append(RankInfo(rank=rank, replica=rep.replica, node=rep.node, local_rank=local,
                                dp=c.dp, pp=c.pp, tp=c.tp, blocks=tuple(bounds[c.pp + k * pp] for k in range(v))))
    return sorted(out, key=lambda r: r.rank)


def groups(layout: Layout) -> dict[str, list[list[int]]]:
    mesh = mesh_of(layout)
    return {"tp": mesh.tp_groups(), "pp": mesh.pp_groups(), "dp": mesh.dp_groups()}


def tp_groups_split_nodes(plan: Plan) -> list[list[int]]:
    """Tensor-parallel groups whose ranks sit on more than one node (should be none)."""
    node_of = {r: rep.node for rep in plan.replicas for r in rep.ranks}
    return [g for g in mesh_of(plan.layout).tp_groups() if len({node_of[r] for r in g}) > 1]


def pipeline_summary(job: SeqTrainJob) -> dict:
    opt = job.spec.optimization
    m = pipeline_micro_batches(job)
    v = INTERLEAVED_CHUNKS if opt.pipeline_schedule == "interleaved" else 1
    return {
        "stages": opt.pipeline_parallel,
        "schedule": opt.pipeline_schedule if opt.pipeline_parallel > 1 else "none",
        "microBatches": m,
        "virtualStagesPerRank": v,
        "bubbleFraction": bubble_fraction(opt.pipeline_schedule, opt.pipeline_parallel, m, v),
    }
