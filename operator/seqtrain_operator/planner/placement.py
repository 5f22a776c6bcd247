"""GPU-topology placement (pure): free node capacity -> replica -> node, all replicas or none.

Every replica asks for the same resources, so a node's room is a whole number of replicas
(min over GPUs, CPU, memory) and the placement can never over-commit a node. Topology domains are the values of
`scheduling.topology.keys` (outermost first, e.g. zone then rack then NVLink domain); a node without one of the
labels is a domain of its own, so it never joins a domain by accident.

Policies:
- none: fewest nodes, ignoring topology.
- pack: fewest domains at every level (the smallest single domain that fits, else the largest first), then fewest
  nodes inside each domain.
- require: one innermost domain must hold the whole gang; otherwise unschedulable.
- spread: replicas round-robin over domains (fault isolation), then over nodes.

Rank layout: replicas are numbered in (domain, node) order, and replica r gets the contiguous ranks
[r*procs, (r+1)*procs). With ranks ordered dp-major, then pp, then tp (tp fastest), a tensor-parallel group lies
inside one replica (tp divides procs), and pipeline neighbours are adjacent replicas, hence in the same node or
domain whenever the gang allows.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from seqtrain.spec import SeqTrainJob
from seqtrain.spec.cluster import Toleration
from seqtrain_operator.planner.affinity import Terms, matches, required_terms
from seqtrain_operator.planner.inventory import GPU_PRODUCT_LABEL, GPU_RESOURCE, Requests, pod_requests
from seqtrain_operator.planner.local import layout_of
from seqtrain_operator.planner.types import Node, Plan, ReplicaAssignment, Unschedulable

NO_LABEL = "<none>"


@dataclass(frozen=True)
class Demand:
    """What one replica asks for, and the node constraints every replica shares."""

    replicas: int
    gpus: int
    cpu_millis: int
    memory_bytes: int
    gpu_product: str | None = None
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    other: tuple[tuple[str, int], ...] = ()  # ephemeral-storage bytes, other extended resources
    node_terms: Terms = ()  # the pod template's required node affinity (nodeSelectorTerms), ANDed with the pin

    @classmethod
    def of(cls, job: SeqTrainJob) -> Demand:
        s = job.spec
        r = replica_requests(job)
        return cls(
            replicas=s.replicas, gpus=r.gpus, cpu_millis=r.cpu_millis, memory_bytes=r.memory_bytes,
            gpu_product=s.resources.gpu_product,
            node_selector=tuple(sorted(s.scheduling.node_selector.items())),
            tolerations=pod_tolerations(job),
            other=tuple((k, v) for k, v in r.other if v),
            node_terms=required_terms(s.pod_template.spec.affinity),
        )

    def describe(self) -> str:
        parts = [f"{self.gpus} GPU"] if self.gpus else []
        parts += [f"{self.cpu_millis}m CPU", f"{self.memory_bytes / 2**30:.3g}Gi memory"]
        parts += [f"{v} {k}" for k, v in self.other if k != "ephemeral-storage"]
        return ", ".join(parts)


def replica_requests(job: SeqTrainJob) -> Requests:
    """What one replica's pod requests, as kube-scheduler adds it up: the trainer container (spec.resources plus
    the extended resources of the podTemplate's `trainer` entry), the template's
    sidecars (native sidecars: summed) and init containers (the largest, beside the sidecars started before it).
    Placing by spec.resources alone pinned pods to nodes without the template's rdma/ib, or over-committed CPU
    with a sidecar's requests, and such pods stay Pending for ever."""
    s = job.spec
    res = s.resources
    requests: dict[str, str] = {"cpu": res.cpu, "memory": res.memory}
    if res.ephemeral_storage:
        requests["ephemeral-storage"] = res.ephemeral_storage
    if res.gpus:
        requests[GPU_RESOURCE] = str(res.gpus)
    requests = {**s.pod_template.extended_resources(), **requests}  # as k8s/pods/template.py merges them
    t = s.pod_template.spec
    pod = {"spec": {"containers": [{"name": "trainer", "resources": {"requests": requests}}],
                    "initContainers": [*t.init_containers,
                                       *({**c, "restartPolicy": "Always"} for c in s.pod_template.sidecars())]}}
    r = pod_requests(pod)
    return Requests(r.gpus, r.cpu_millis, r.memory_bytes, 0, r.other)


def pod_tolerations(job: SeqTrainJob) -> tuple[Toleration, ...]:
    """The tolerations the job's pods carry: spec.scheduling.tolerations, plus `nvidia.com/gpu:Exists:NoSchedule`
    on GPU pods: what the ExtendedResourceToleration admission plugin adds, so GPU pools tainted the way managed
    clouds taint them work (the operator adds it to the pods itself, so it holds where the plugin is off)."""
    tols = list(job.spec.scheduling.tolerations)
    if job.spec.resources.gpus:
        tols.append(Toleration(key=GPU_RESOURCE, operator="Exists", effect="NoSchedule"))
    return tuple(tols)


def tolerates(tolerations: Iterable[Toleration], taint: tuple[str, str, str]) -> bool:
    """Kubernetes toleration matching (core/v1 Toleration.ToleratesTaint)."""
    key, value, effect = taint
    for t in tolerations:
        if t.effect and t.effect != effect:
            continue
        if not t.key:  # empty key + Exists tolerates everything
            if t.operator == "Exists":
                return True
            continue
        if t.key != key:
            continue
        if t.operator == "Exists" or (t.value or "") == value:
            return True
    return False


def exclusion(node: Node, demand: Demand) -> str | None:
    """Why a node can take no replica at all regardless of its free room (None: eligible)."""
    if not node.ready:
        return "NotReady"
    if not node.schedulable:
        return "cordoned"
    for taint in node.taints:
        if taint[2] in ("NoSchedule", "NoExecute") and not tolerates(demand.tolerations, taint):
            return f"taint {taint[0]}{'=' + taint[1] if taint[1] else ''}:{taint[2]} not tolerated"
    for key, value in demand.node_selector:
        if node.labels.get(key) != value:
            return f"nodeSelector {key}={value} not matched"
    if demand.gpu_product and node.labels.get(GPU_PRODUCT_LABEL) != demand.gpu_product:
        return f"{GPU_PRODUCT_LABEL} is not {demand.gpu_product}"
    if not matches(demand.node_terms, node.name, node.labels):
        return "podTemplate node affinity not matched"
    return None


def room(node: Node, demand: Demand) -> int:
    """How many replicas fit into the node's free capacity (whole replicas only)."""
    fits = [demand.replicas]
    if demand.gpus:
        fits.append(node.gpus // demand.gpus)
    if demand.cpu_millis:
        fits.append(node.cpu_millis // demand.cpu_millis)
    if demand.memory_bytes:
        fits.append(node.memory_bytes // demand.memory_bytes)
    if node.pods is not None:
        fits.append(node.pods)  # one pod per replica
    for resource, need in demand.other:
        if need:
            fits.append(node.other.get(resource, 0) // need)
    return max(0, min(fits))


def domain_of(node: Node, keys: Sequence[str]) -> tuple[str, ...]:
    # A node missing a key gets a private value: it must not merge with other unlabelled nodes into one "domain".
    return tuple(node.labels.get(k, f"{NO_LABEL}:{node.name}") for k in keys)


# ---- choosing how many replicas go to each node ---------------------------------------------------------------

_Slot = tuple[Node, int]  # node and its room


def _pack(slots: list[_Slot], keys: Sequence[str], level: int, need: int) -> dict[str, int] | None:
    """Fewest groups at this level (best fit if one suffices, else largest first), recursing to nodes."""
    total = sum(r for _, r in slots)
    if total < need:
        return None
    if level == len(keys):  # nodes
        ordered = sorted(slots, key=lambda s: (-s[1], s[0].name))
        single = sorted((s for s in slots if s[1] >= need), key=lambda s: (s[1], s[0].name))
        if single:
            return {single[0][0].name: need}
        out: dict[str, int] = {}
        for node, r in ordered:
            take = min(r, need - sum(out.values()))
            if take:
                out[node.name] = take
        return out
    groups: dict[str, list[_Slot]] = defaultdict(list)
    for node, r in slots:
        groups[domain_of(node, keys)[level]].append((node, r))
    cap = {g: sum(r for _, r in members) for g, members in groups.items()}
    fitting = sorted((g for g in groups if cap[g] >= need), key=lambda g: (cap[g], g))
    if fitting:
        return _pack(groups[fitting[0]], keys, level + 1, need)
    out = {}
    for g in sorted(groups, key=lambda g: (-cap[g], g)):
        left = need - sum(out.values())
        if left == 0:
            break
        part = _pack(groups[g], keys, level + 1, min(cap[g], left))
        assert part is not None  # the group holds at least that much by construction
        out.update(part)
    return out


def _spread(slots: list[_Slot], keys: Sequence[str], need: int) -> dict[str, int] | None:
    """One replica at a time to the domain with the fewest so far, then the node with the fewest so far."""
    if sum(r for _, r in slots) < need:
        return None
    left = {n.name: r for n, r in slots}
    by_domain: dict[tuple[str, ...], list[Node]] = defaultdict(list)
    for node, _ in slots:
        by_domain[domain_of(node, keys)].append(node)
    per_domain: Counter[tuple[str, ...]] = Counter()
    out: Counter[str] = Counter()
    for _ in range(need):
        open_domains = [d for d, nodes in by_domain.items() if any(left[n.name] for n in nodes)]
        d = min(open_domains, key=lambda d: (per_domain[d], -sum(left[n.name] for n in by_domain[d]), d))
        node = min((n for n in by_domain[d] if left[n.name]), key=lambda n: (out[n.name], -left[n.name], n.name))
        left[node.name] -= 1
        out[node.name] += 1
        per_domain[d] += 1
    return dict(out)


def _require(slots: list[_Slot], keys: Sequence[str], need: int) -> dict[str, int] | None:
    by_domain: dict[tuple[str, ...], list[_Slot]] = defaultdict(list)
    for node, r in slots:
        by_domain[domain_of(node, keys)].append((node, r))
    fitting = sorted((d for d, s in by_domain.items() if sum(r for _, r in s) >= need),
                     key=lambda d: (sum(r for _, r in by_domain[d]), d))
    if not fitting:
        return None
    return _pack(by_domain[fitting[0]], (), 0, need)


# ---- the planner's entry point --------------------------------------------------------------------------------


def place_demand(demand: Demand, nodes: Sequence[Node], policy: str, keys: Sequence[str],
                 avoid: Iterable[str] = ()) -> dict[str, int] | Unschedulable:
    """node name -> replica count for the whole gang, or why it cannot be placed now.

    Nodes in `avoid` (failed recently) are used only if the gang cannot be placed without them.
    """
    keys = tuple(keys) if policy != "none" else ()
    avoid = set(avoid)
    excluded: dict[str, str] = {}
    slots: list[_Slot] = []
    for node in sorted(nodes, key=lambda n: n.name):
        why = exclusion(node, demand)
        if why:
            excluded[node.name] = why
        else:
            slots.append((node, room(node, demand)))
    fn = {"spread": lambda s: _spread(s, keys, demand.replicas),
          "require": lambda s: _require(s, keys, demand.replicas)}.get(
        policy, lambda s: _pack(s, keys, 0, demand.replicas))
    preferred = [s for s in slots if s[0].name not in avoid]
    result = fn(preferred) if len(preferred) < len(slots) else None
    if result is None:
        result = fn(slots)
    if result is not None:
        return result
    return Unschedulable(_explain(demand, slots, excluded, policy, keys))


def _explain(demand: Demand, slots: list[_Slot], excluded: dict[str, str], policy: str,
             keys: Sequence[str]) -> str:
    fit = sum(r for _, r in slots)
    msg = f"need {demand.replicas} replicas x ({demand.describe()})"
    if policy == "require" and fit >= demand.replicas:
        cap: Counter[tuple[str, ...]] = Counter()
        for node, r in slots:
            cap[domain_of(node, keys)] += r
        best = max(cap.values(), default=0)
        msg += (f" in one topology domain of {', '.join(keys)} (policy require); the largest domain has room "
                f"for {best}")
    else:
        with_room = [f"{n.name}: {r}" for n, r in slots if r]
        msg += f"; free capacity fits {fit}" + (f" ({', '.join(with_room[:8])})" if with_room else "")
    if excluded:
        reasons = Counter(excluded.values())
        msg += "; excluded: " + ", ".join(f"{c} {why}" for why, c in sorted(reasons.items()))
    return msg


def place(job: SeqTrainJob, nodes: Sequence[Node], avoid: Iterable[str] = ()) -> Plan | Unschedulable:
    """The gang's Plan on these nodes (free capacity), or Unschedulable with what is missing."""
    demand = Demand.of(job)
    topo = job.spec.scheduling.topology
    counts = place_demand(demand, nodes, topo.policy, topo.keys, avoid)
    if isinstance(counts, Unschedulable):
        return counts
    keys = tuple(topo.keys) if topo.policy != "none" else ()
    by_name = {n.name: n for n in nodes}
    # Adjacent replica numbers share a node, then a domain: pipeline neighbours stay close.
    slots = sorted(counts.items(), key=lambda kv: (domain_of(by_name[kv[0]], topo.keys), kv[0]))
    procs = job.spec.resources.procs
    replicas: list[ReplicaAssignment] = []
    for name, count in slots:
        for _ in range(count):
            r = len(replicas)
            replicas.append(ReplicaAssignment(replica=r, node=name, ranks=tuple(range(r * procs, (r + 1) * procs)),
                                              domain=domain_of(by_name[name], keys)))
    domains = Counter(a.domain for a in replicas)
    notes = [f"policy {topo.policy}: {len(counts)} node(s)" + (f", {len(domains)} domain(s) of {', '.join(keys)}"
                                                                 if keys else "")]
    return Plan(world_size=job.spec.world_size, procs_per_replica=procs, layout=layout_of(job),
                replicas=tuple(replicas), notes=tuple(notes))
