"""`seqtrain plan FILE [--nodes NODES.yaml] [--set ...] [--json]`: the resolved plan, without running anything."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence

import yaml

from seqtrain.spec import SeqTrainJob, SpecError, load_job_file
from seqtrain.spec.datafiles import data_notes
from seqtrain.spec.memory import memory_notes, with_micro_batch
from seqtrain.spec.optimization import describe_compile, describe_precision, resolve_fused_projections
from seqtrain.spec.resolve import paths_readable, resolve_model
from seqtrain_operator.planner.fit import memory_problems
from seqtrain_operator.planner.inventory import cpu_millis, inventory, memory_bytes
from seqtrain_operator.planner.layout import groups, pipeline_summary, rank_table, tp_groups_split_nodes
from seqtrain_operator.planner.local import local_plan
from seqtrain_operator.planner.memory import MemoryEstimate, estimate, gib, model_state_bytes
from seqtrain_operator.planner.placement import place
from seqtrain_operator.planner.types import Node, Plan, Unschedulable

EXIT_OK, EXIT_UNSCHEDULABLE, EXIT_INVALID = 0, 1, 2


def read_nodes(path: str) -> list[Node]:
    """Node inventory: `kubectl get nodes -o yaml` output (a List with items), or a plain YAML list (or
    {nodes: [...]}) of {name, gpus, cpu, memory, labels} giving free capacity."""
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    if isinstance(doc, dict) and isinstance(doc.get("items"), list):
        return inventory(doc["items"], [])
    items = doc.get("nodes", []) if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a list of nodes (name, gpus, cpu, memory, labels)")
    out = []
    for i, it in enumerate(items):
        if not isinstance(it, dict) or "name" not in it:
            raise ValueError(f"{path}: node {i} needs at least a name")
        out.append(Node(name=str(it["name"]), gpus=int(it.get("gpus", 0)),
                        cpu_millis=cpu_millis(it.get("cpu", 0)), memory_bytes=memory_bytes(it.get("memory", 0)),
                        labels={str(k): str(v) for k, v in (it.get("labels") or {}).items()},
                        schedulable=bool(it.get("schedulable", True)), ready=bool(it.get("ready", True))))
    return out


def _cluster_plan(job: SeqTrainJob, nodes: list[Node]) -> Plan | Unschedulable:
    return place(job, nodes)


def plan_dict(job: SeqTrainJob, plan: Plan) -> dict:
    est = estimate(job)
    auto = job.spec.training.micro_batch_size == "auto"
    mem_notes = memory_notes(job, est)
    job = with_micro_batch(job, est.micro_batch) if auto else job  # the rest of the plan is that of auto's choice
    resolved = resolve_model(job)
    m = resolved.model
    return {
        "job": job.name,
        "worldSize": plan.world_size,
        "layout": {"dp": plan.layout.dp, "tp": plan.layout.tp, "pp": plan.layout.pp},
        "engine": est.engine,
        "zeroStage": est.zero_stage,
        "precision": describe_precision(job.spec.optimization.precision, job.spec.resources.gpus),
        "compile": describe_compile(job.spec.optimization.compile, job.spec.resources.gpus),
        "fusedProjections": resolve_fused_projections(job.spec.optimization)[1],
        "model": {"arch": m.arch, "params": est.total_params, "layers": m.layers, "dim": m.dim,
                  "trainableParams": est.trainable_params if est.trainable_params is not None else est.total_params,
                  "derived": resolved.derivations()},
        "replicas": [{"replica": r.replica, "node": r.node, "ranks": list(r.ranks)} for r in plan.replicas],
        "groups": groups(plan.layout),
        "ranks": [r.to_dict() for r in rank_table(job, plan)],
        "pipeline": pipeline_summary(job),
        "microBatch": est.micro_batch,
        "microBatchAuto": auto,
        "processBaseline": est.baseline,
        "hostPerRank": est.host_per_rank(job.spec.resources.gpus),
        "memoryPerRank": [s.to_dict() for s in est.stages],
        "notes": list(plan.notes) + mem_notes + _notes(job, plan, est) + data_notes(job, paths_readable()),
    }


def _notes(job: SeqTrainJob, plan: Plan, est: MemoryEstimate) -> list[str]:
    out = []
    split = tp_groups_split_nodes(plan)
    if split:
        out.append(f"tensor-parallel groups {split} span nodes: every sublayer all-reduce crosses the network")
    if plan.layout.dp > 1 and est.engine != "fsdp2":
        b = est.busiest
        opt = job.spec.optimization
        for stage in range(est.zero_stage + 1, 4):
            alt = model_state_bytes(b.params_count, est.precision, stage, plan.layout.dp, opt.zero.offload)
            saved = (b.params + b.grads + b.optimizer) - alt.device
            if saved > 0:
                out.append(f"ZeRO-{stage} would save {gib(saved)} of model states per rank on stage {b.stage}")
                break
    return out


def render(d: dict) -> str:
    lines = [f"job {d['job']}: {d['model']['arch']} {d['model']['params']:,} parameters, "
             f"world {d['worldSize']} = dp {d['layout']['dp']} x pp {d['layout']['pp']} x tp {d['layout']['tp']}"
             + (f", LoRA: {d['model']['trainableParams']:,} trainable (the rest frozen)"
                if d["model"]["trainableParams"] != d["model"]["params"] else ""),
             d["model"]["derived"],
             f"engine {d['engine']} (ZeRO-{d['zeroStage']} accounting), precision {d['precision']}, "
             f"compile {d['compile']}, fused projections {d['fusedProjections']}, "
             f"micro-batch {d['microBatch']} sequences"
             + (" (auto)" if d.get("microBatchAuto") else "")]
    p = d["pipeline"]
    if p["stages"] > 1:
        lines.append(f"pipeline {p['schedule']}: {p['stages']} stages, {p['microBatches']} micro-batches, "
                     f"bubble {p['bubbleFraction']:.1%}")
    lines.append("")
    lines.append(f"{'rank':>4} {'replica':>7} {'node':<16} {'local':>5} {'dp':>3} {'pp':>3} {'tp':>3}  blocks")
    for r in d["ranks"]:
        lines.append(f"{r['rank']:>4} {r['replica']:>7} {r['node']:<16} {r['local_rank']:>5} {r['dp']:>3} "
                     f"{r['pp']:>3} {r['tp']:>3}  " + " ".join(f"[{a}, {b})" for a, b in r["blocks"]))
    lines.append("")
    for kind in ("tp", "pp", "dp"):
        lines.append(f"{kind} groups: {d['groups'][kind]}")
    lines.append("")
    lines.append("memory per rank (estimate, ZeRO-paper accounting):")
    lines.append(f"{'stage':>5} {'params#':>12} {'params':>11} {'grads':>11} {'optimizer':>11} "
                 f"{'activations':>11} {'total':>11} {'offloaded':>11}")
    for s in d["memoryPerRank"]:
        lines.append(f"{s['stage']:>5} {s['params_count']:>12,} {gib(s['params']):>11} {gib(s['grads']):>11} "
                     f"{gib(s['optimizer']):>11} {gib(s['activations']):>11} {gib(s['total']):>11} "
                     f"{gib(s['cpu']):>11}")
    lines.append(f"host memory per rank: {gib(d['hostPerRank'])} (process baseline {gib(d['processBaseline'])} "
                 "included)")
    for n in d["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def say_problems(path: str, problems: Iterable[str]) -> int:
    """Each problem as one `FILE: path: message` line on stderr; returns the invalid-spec exit code."""
    for p in problems:
        print(f"{path}: {p}", file=sys.stderr)
    return EXIT_INVALID


def load_or_say(path: str, overrides: Sequence[str] = ()) -> SeqTrainJob | None:
    """The job in FILE with its --set overrides applied, or None once its problems are said (`say_problems`)."""
    try:
        return load_job_file(path, overrides)
    except SpecError as err:
        say_problems(path, err.problems)
        return None


def plan_command(file: str, nodes_file: str | None = None, overrides: Sequence[str] = (),
                 as_json: bool = False) -> int:
    job = load_or_say(file, overrides)
    if job is None:
        return EXIT_INVALID
    if nodes_file:
        try:
            plan = _cluster_plan(job, read_nodes(nodes_file))
        except (OSError, ValueError, yaml.YAMLError) as exc:
            print(f"{nodes_file}: {exc}", file=sys.stderr)
            return EXIT_INVALID
    else:
        plan = local_plan(job)
    if isinstance(plan, Unschedulable):
        print(f"{file}: unschedulable: {plan.reason}", file=sys.stderr)
        return EXIT_UNSCHEDULABLE
    d = plan_dict(job, plan)
    print(json.dumps(d, indent=2) if as_json else render(d))
    if problems := memory_problems(job):  # after the plan: it shows where the memory goes
        for p in problems:
            print(f"{file}: {p}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK
