"""The plan for a local run: this machine is one node and every replica lands on it."""

from __future__ import annotations

from seqtrain.spec import SeqTrainJob
from seqtrain_operator.planner.types import Layout, Plan, ReplicaAssignment


def layout_of(job: SeqTrainJob) -> Layout:
    opt = job.spec.optimization
    return Layout(dp=job.spec.dp, tp=opt.tensor_parallel, pp=opt.pipeline_parallel)


def local_plan(job: SeqTrainJob, node: str = "localhost") -> Plan:
    """Replica r gets the contiguous ranks [r*procs, (r+1)*procs): tensor-parallel groups stay in a replica."""
    procs = job.spec.resources.procs
    replicas = tuple(
        ReplicaAssignment(replica=r, node=node, ranks=tuple(range(r * procs, (r + 1) * procs)))
        for r in range(job.spec.replicas)
    )
    return Plan(world_size=job.spec.world_size, procs_per_replica=procs, layout=layout_of(job), replicas=replicas)
