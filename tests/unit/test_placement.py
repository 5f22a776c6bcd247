"""GPU-topology placement and cluster inventory: properties over many random clusters, plus table cases."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import make_job
from seqtrain.spec import SeqTrainJob
from seqtrain.spec.cluster import Toleration
from seqtrain_operator.planner.inventory import (
    Requests,
    cpu_millis,
    inventory,
    memory_bytes,
    parse_quantity,
    pod_requests,
)
from seqtrain_operator.planner.placement import Demand, domain_of, place, place_demand, room, tolerates
from seqtrain_operator.planner.types import Node, Plan, Unschedulable

GI = 2**30
ZONE = "topology.kubernetes.io/zone"
RACK = "example.com/rack"


def job(replicas=2, gpus=1, procs=None, policy="pack", keys=(ZONE,), tp=1, pp=1, cpu="1", memory="1Gi", **sched):
    res = {"gpus": gpus, "cpu": cpu, "memory": memory}
    if procs:
        res["processesPerReplica"] = procs
    return SeqTrainJob.model_validate(make_job(
        "j", replicas=replicas, resources=res, optimization={"tensorParallel": tp, "pipelineParallel": pp},
        scheduling={"topology": {"policy": policy, "keys": list(keys)}, **sched}))


def node(name, gpus=8, cpu=64_000, mem=512 * GI, **labels):
    return Node(name=name, gpus=gpus, cpu_millis=cpu, memory_bytes=mem, labels=labels)


# ---- inventory ------------------------------------------------------------------------------------------------


def test_quantities():
    assert cpu_millis("500m") == 500 and cpu_millis(2) == 2000 and cpu_millis("0.1") == 100
    assert memory_bytes("8Gi") == 8 * GI and memory_bytes("1G") == 10**9 and memory_bytes("1e3") == 1000
    assert parse_quantity("1.5Ki") == 1536
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity("12 GB")


def test_pod_requests_limits_default_init_containers_overhead():
    pod = {"spec": {
        "containers": [{"resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": 2}}},
                       {"resources": {"requests": {"cpu": "500m"}}}],
        "initContainers": [{"resources": {"requests": {"cpu": "4"}}}],
        "overhead": {"memory": "128Mi"},
    }}
    assert pod_requests(pod) == Requests(gpus=2, cpu_millis=4000, memory_bytes=GI + 128 * 2**20, pods=1)


def test_native_sidecar_requests_are_summed_with_the_containers():
    sidecar = {"restartPolicy": "Always", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}
    pod = {"spec": {"containers": [{"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
                    "initContainers": [{"resources": {"requests": {"cpu": "1"}}}, sidecar,
                                       {"resources": {"requests": {"cpu": "1"}}}]}}
    # the sidecar runs beside the trainer (1.5 CPUs, 2 GiB) and beside the init container after it (1.5 CPUs)
    assert pod_requests(pod) == Requests(cpu_millis=1500, memory_bytes=2 * GI, pods=1)


def _k8s_node(name, gpus=8, ready="True", unschedulable=False, taints=(), **labels):
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"unschedulable": unschedulable, "taints": list(taints)},
            "status": {"allocatable": {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": str(gpus)},
                       "conditions": [{"type": "Ready", "status": ready}]}}


def _pod(node_name, phase="Running", gpus=1, cpu="2"):
    return {"spec": {"nodeName": node_name, "containers": [
        {"resources": {"requests": {"cpu": cpu}, "limits": {"nvidia.com/gpu": gpus}}}]},
            "status": {"phase": phase}}


def test_inventory_subtracts_running_pods_only():
    nodes = [_k8s_node("a"), _k8s_node("b", ready="False"), _k8s_node("c", unschedulable=True,
                                                                     taints=[{"key": "k", "effect": "NoSchedule"}])]
    pods = [_pod("a", gpus=3), _pod("a", phase="Succeeded", gpus=4), _pod("a", phase="Pending", gpus=1),
            _pod(None, gpus=8)]
    inv = {n.name: n for n in inventory(nodes, pods)}
    assert inv["a"].gpus == 4 and inv["a"].cpu_millis == 32000 - 4000
    assert not inv["b"].ready and inv["b"].gpus == 8
    assert not inv["c"].schedulable and inv["c"].taints == (("k", "", "NoSchedule"),)


# ---- table cases ----------------------------------------------------------------------------------------------


def test_pack_prefers_one_domain_best_fit():
    nodes = [node("a1", 8, **{ZONE: "a"}), node("a2", 8, **{ZONE: "a"}), node("b1", 4, **{ZONE: "b"}),
             node("b2", 4, **{ZONE: "b"})]
    plan = place(job(replicas=4, gpus=2), nodes)
    assert isinstance(plan, Plan)
    # zone b holds exactly 4 replicas and is the smallest domain that fits: a stays free for bigger gangs
    assert {a.domain for a in plan.replicas} == {("b",)}


def test_pack_uses_fewest_domains_when_none_fits_alone():
    nodes = [node(f"{z}{i}", 8, **{ZONE: z}) for z, n in (("a", 1), ("b", 3), ("c", 2)) for i in range(n)]
    plan = place(job(replicas=5, gpus=8), nodes)
    assert isinstance(plan, Plan)
    assert Counter(a.domain[0] for a in plan.replicas) == {"b": 3, "c": 2}


def test_require_one_domain_or_unschedulable_with_reason():
    nodes = [node("a1", 8, **{ZONE: "a"}), node("b1", 8, **{ZONE: "b"})]
    out = place(job(replicas=2, gpus=8, policy="require"), nodes)
    assert isinstance(out, Unschedulable)
    assert "one topology domain" in out.reason and "largest domain has room for 1" in out.reason
    ok = place(job(replicas=2, gpus=4, policy="require"), nodes)
    assert isinstance(ok, Plan) and len({a.domain for a in ok.replicas}) == 1


def test_spread_round_robins_domains():
    nodes = [node(f"{z}{i}", 8, **{ZONE: z}) for z in "abc" for i in range(2)]
    plan = place(job(replicas=6, gpus=1, policy="spread"), nodes)
    assert isinstance(plan, Plan)
    assert Counter(a.domain[0] for a in plan.replicas) == {"a": 2, "b": 2, "c": 2}
    assert len({a.node for a in plan.replicas}) == 6


def test_unschedulable_names_what_is_missing():
    nodes = [node("a", 2), Node("cordoned", gpus=8, cpu_millis=10**6, memory_bytes=10**12, schedulable=False),
             Node("down", gpus=8, cpu_millis=10**6, memory_bytes=10**12, ready=False)]
    out = place(job(replicas=3, gpus=2), nodes)
    assert isinstance(out, Unschedulable)
    assert "need 3 replicas x (2 GPU" in out.reason and "fits 1 (a: 1)" in out.reason
    assert "1 NotReady" in out.reason and "1 cordoned" in out.reason


def test_taints_selector_and_gpu_product():
    tainted = Node("t", gpus=8, cpu_millis=10**6, memory_bytes=10**12, taints=(("gpu", "h100", "NoSchedule"),))
    wrong = node("w", **{"nvidia.com/gpu.product": "A100", "pool": "train"})
    right = node("r", **{"nvidia.com/gpu.product": "H100", "pool": "train"})
    j = job(replicas=1, gpus=8, nodeSelector={"pool": "train"})
    j.spec.resources.gpu_product = "H100"
    plan = place(j, [tainted, wrong, right])
    assert isinstance(plan, Plan) and plan.replicas[0].node == "r"
    tol = job(replicas=1, gpus=8, policy="none", tolerations=[{"key": "gpu", "operator": "Exists"}])
    plan2 = place(tol, [tainted])
    assert isinstance(plan2, Plan) and plan2.replicas[0].node == "t"
    assert tolerates([Toleration(operator="Exists")], ("any", "x", "NoExecute"))
    assert not tolerates([Toleration(key="gpu", value="a100")], ("gpu", "h100", "NoSchedule"))


def test_avoided_nodes_used_only_when_needed():
    nodes = [node("a", 8), node("b", 8)]
    plan = place(job(replicas=1, gpus=8, policy="none"), nodes, avoid={"a"})
    assert isinstance(plan, Plan) and plan.replicas[0].node == "b"
    plan = place(job(replicas=2, gpus=8, policy="none"), nodes, avoid={"a"})
    assert isinstance(plan, Plan) and {a.node for a in plan.replicas} == {"a", "b"}


def test_cpu_fallback_places_on_nodes_without_gpus():
    nodes = [Node("kind-worker", cpu_millis=4000, memory_bytes=8 * GI),
             Node("kind-worker2", cpu_millis=4000, memory_bytes=8 * GI)]
    plan = place(job(replicas=2, gpus=0, cpu="2", memory="3Gi", policy="spread", keys=("kubernetes.io/hostname",)),
                 nodes)
    assert isinstance(plan, Plan) and {a.node for a in plan.replicas} == {"kind-worker", "kind-worker2"}


def test_rank_layout_tp_inside_replica_pp_neighbours_share_domain():
    # 4 replicas x 4 GPUs, tp=4 (one replica), pp=2: stages 0/1 of each dp group are adjacent replicas.
    nodes = [node(f"{z}{i}", 4, **{ZONE: z}) for z in "ab" for i in range(2)]
    plan = place(job(replicas=4, gpus=4, tp=4, pp=2, policy="spread"), nodes)
    assert isinstance(plan, Plan)
    assert plan.layout.tp == 4 and plan.layout.pp == 2 and plan.layout.dp == 2
    for a in plan.replicas:
        assert a.ranks == tuple(range(a.replica * 4, a.replica * 4 + 4))
        tp_groups = {rank // plan.layout.tp for rank in a.ranks}
        assert len(tp_groups) == 1  # one whole tensor-parallel group per replica
    # pipeline group g holds replicas 2g and 2g+1: same domain
    for g in range(2):
        assert plan.replicas[2 * g].domain == plan.replicas[2 * g + 1].domain


# ---- properties over random clusters --------------------------------------------------------------------------

_label = st.sampled_from(["a", "b", "c", "d"])


@st.composite
def clusters(draw):
    n = draw(st.integers(0, 12))
    nodes = []
    for i in range(n):
        labels = {}
        if draw(st.booleans()) or draw(st.booleans()):
            labels[ZONE] = draw(_label)
            if draw(st.booleans()):
                labels[RACK] = labels[ZONE] + draw(_label)
        nodes.append(Node(
            name=f"n{i:02d}", gpus=draw(st.sampled_from([0, 1, 2, 4, 8])), cpu_millis=draw(st.integers(0, 16)) * 1000,
            memory_bytes=draw(st.integers(0, 64)) * GI, labels=labels,
            schedulable=draw(st.booleans()) or draw(st.booleans()), ready=draw(st.booleans()) or draw(st.booleans()),
        ))
    return nodes


demands = st.builds(Demand, replicas=st.integers(1, 10), gpus=st.sampled_from([0, 1, 2, 4, 8]),
                    cpu_millis=st.integers(0, 8).map(lambda c: c * 1000),
                    memory_bytes=st.integers(0, 16).map(lambda m: m * GI))
policies = st.sampled_from(["none", "pack", "require", "spread"])
key_sets = st.sampled_from([(ZONE,), (ZONE, RACK), (RACK,)])


def _usable(nodes, demand):
    return [n for n in nodes if n.ready and n.schedulable]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), demands, policies, key_sets, st.sets(st.sampled_from([f"n{i:02d}" for i in range(12)])))
def test_placement_properties(nodes, demand, policy, keys, avoid):
    out = place_demand(demand, nodes, policy, keys, avoid)
    usable = _usable(nodes, demand)
    total_room = sum(room(n, demand) for n in usable)
    eff_keys = () if policy == "none" else keys
    dom_room = Counter()
    for n in usable:
        dom_room[domain_of(n, eff_keys)] += room(n, demand)
    if policy == "require":
        possible = any(r >= demand.replicas for r in dom_room.values())
    else:
        possible = total_room >= demand.replicas
    # all-or-nothing: a plan exactly when the whole gang fits
    assert isinstance(out, dict) == possible, out
    if not isinstance(out, dict):
        assert f"need {demand.replicas} replicas" in out.reason
        return
    by_name = {n.name: n for n in nodes}
    assert sum(out.values()) == demand.replicas and all(c > 0 for c in out.values())
    for name, count in out.items():
        n = by_name[name]
        # never over-commit, never an ineligible node
        assert n.ready and n.schedulable
        assert count * demand.gpus <= n.gpus
        assert count * demand.cpu_millis <= n.cpu_millis
        assert count * demand.memory_bytes <= n.memory_bytes
    # avoided nodes only when the gang does not fit without them
    if set(out) & avoid:
        rest = [n for n in usable if n.name not in avoid]
        if policy == "require":
            rd = Counter()
            for n in rest:
                rd[domain_of(n, eff_keys)] += room(n, demand)
            assert not any(r >= demand.replicas for r in rd.values())
        else:
            assert sum(room(n, demand) for n in rest) < demand.replicas
    used = Counter()
    for name, count in out.items():
        used[domain_of(by_name[name], eff_keys)] += count
    if avoid & set(by_name):
        return  # the topology optimum below is over the non-avoided nodes; skip the comparison
    if policy == "require":
        assert len(used) == 1
    if policy in ("pack", "none") and len(eff_keys) <= 1:
        # fewest domains: greedy over domain capacities is optimal
        caps = sorted(dom_room.values(), reverse=True)
        k, acc = 0, 0
        while acc < demand.replicas:
            acc += caps[k]
            k += 1
        assert len(used) == k
    if policy == "spread":
        # balanced: a domain below (max - 1) replicas must have had no more room
        top = max(used.values())
        for d, r in dom_room.items():
            if used.get(d, 0) < top - 1:
                assert used.get(d, 0) == r


@settings(max_examples=100, deadline=None)
@given(clusters(), st.integers(1, 6), st.sampled_from([1, 2]), policies)
def test_plan_ranks_cover_world_and_domains_are_contiguous(nodes, replicas, procs, policy):
    j = job(replicas=replicas, gpus=0, procs=procs, policy=policy, keys=(ZONE,), cpu="1", memory="1Gi")
    out = place(j, nodes)
    if isinstance(out, Unschedulable):
        return
    ranks = [r for a in out.replicas for r in a.ranks]
    assert ranks == list(range(replicas * procs)) and out.world_size == replicas * procs
    # replicas of one domain form one contiguous block of replica numbers (neighbours stay together)
    seen, prev = set(), None
    for a in out.replicas:
        if a.domain != prev:
            assert a.domain not in seen
            seen.add(a.domain)
            prev = a.domain


# ---- admission that agrees with kube-scheduler -----------------------------------------------------------------


def k8s_node(name, gpus=8, cpu="32", memory="256Gi", pods=None, taints=(), **extra):
    """A Node object as the apiserver returns it (allocatable, Ready, taints)."""
    alloc = {"cpu": cpu, "memory": memory, "nvidia.com/gpu": str(gpus), **extra}
    if pods is not None:
        alloc["pods"] = str(pods)
    return {"metadata": {"name": name, "labels": {}}, "spec": {"taints": list(taints)},
            "status": {"allocatable": alloc, "conditions": [{"type": "Ready", "status": "True"}]}}


def job_pod(job_name, node=None, pinned=None, gpus=1, phase="Pending", nominated=None, **requests):
    """A pod of another job: bound (node), created and pinned but not bound yet (pinned), or nominated."""
    spec = {"containers": [{"resources": {"requests": {"cpu": "1", **requests},
                                          "limits": {"nvidia.com/gpu": gpus}}}]}
    if node:
        spec["nodeName"] = node
    if pinned:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pinned]}]}]}}}
    status = {"phase": phase}
    if nominated:
        status["nominatedNodeName"] = nominated
    return {"metadata": {"name": f"{job_name}-pod"}, "spec": spec, "status": status}


def test_pods_created_but_not_bound_count_so_two_jobs_never_claim_the_same_gpus():
    nodes = [k8s_node("g1", gpus=8)]
    # job A was admitted a moment ago: its pods exist, pinned to g1, not bound yet
    a_pods = [job_pod("a", pinned="g1", gpus=4), job_pod("a", pinned="g1", gpus=4)]
    b = place(job(replicas=1, gpus=4), inventory(nodes, a_pods))
    assert isinstance(b, Unschedulable) and "free capacity fits 0" in b.reason
    # the scheduler's nomination counts too; unpinned, unnominated pending pods do not (the scheduler decides)
    assert inventory(nodes, [job_pod("c", nominated="g1", gpus=8)])[0].gpus == 0
    assert inventory(nodes, [job_pod("d", gpus=8)])[0].gpus == 8


def test_pod_count_limit_ephemeral_storage_and_other_extended_resources_are_counted():
    nodes = [k8s_node("n", gpus=8, pods=3, **{"ephemeral-storage": "100Gi", "example.com/fpga": "2"})]
    busy = [job_pod("x", node="n", gpus=0, phase="Running", **{"ephemeral-storage": "90Gi", "example.com/fpga": "1"}),
            job_pod("y", node="n", gpus=0, phase="Running")]
    (inv,) = inventory(nodes, busy)
    assert inv.pods == 1 and inv.other == {"ephemeral-storage": 10 * GI, "example.com/fpga": 1}
    full = place(job(replicas=2, gpus=1, keys=()), [inv])  # 8 GPUs free but room for one more pod only
    assert isinstance(full, Unschedulable)
    disk = job(replicas=1, gpus=1, keys=())
    disk.spec.resources.ephemeral_storage = "20Gi"
    assert isinstance(place(disk, [inv]), Unschedulable)
    disk.spec.resources.ephemeral_storage = "10Gi"
    assert isinstance(place(disk, [inv]), Plan)


def test_gpu_pool_tainted_like_managed_clouds_works_for_gpu_jobs_only():
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    inv = inventory([k8s_node("g", gpus=8, taints=[taint])], [])
    assert isinstance(place(job(replicas=1, gpus=1, keys=()), inv), Plan)
    cpu_only = place(job(replicas=1, gpus=0, keys=()), inv)
    assert isinstance(cpu_only, Unschedulable) and "taint nvidia.com/gpu=present:NoSchedule" in cpu_only.reason


def test_admissions_share_one_cluster_wide_list_and_count_the_pods_created_since(monkeypatch):
    """Without an index: one LIST of every pod serves the admissions within its ttl; reserved gangs count as busy
    until a LIST shows them; the admitted job's own pods from that LIST do not (it has none live: they are its
    previous gang, going)."""
    import asyncio

    from seqtrain_operator.k8s.capacity import busy as busy_mod
    from seqtrain_operator.k8s.passes import reconcile

    new = job_pod("new", pinned="g3", gpus=8)
    new["metadata"]["namespace"] = "ml"

    class Kube:
        lists = 0
        has_new = False

        async def list_pods(self, namespace, label_selector="", field_selector=""):  # noqa: ANN001, ANN202
            Kube.lists += 1
            assert namespace is None and label_selector == "" and "status.phase!=Succeeded" in field_selector
            old = job_pod("old", node="g1", gpus=8, phase="Running")
            old["metadata"].update(namespace="ml", labels={"seqtrain.dev/job": "gpt"})
            return [job_pod("other", node="g2", gpus=8, phase="Running"), old, *([new] if Kube.has_new else [])]

    clock = [100.0]
    monkeypatch.setattr(busy_mod.time, "monotonic", lambda: clock[0])
    nodes, busy, kube = [k8s_node("g1"), k8s_node("g2"), k8s_node("g3")], reconcile.BusyPods(ttl=5.0), Kube()

    def free(job_key):  # noqa: ANN001, ANN202
        return {n.name: n.gpus for n in asyncio.run(reconcile.capacity(kube, nodes, busy, job_key))}

    assert free(("ml", "gpt")) == {"g1": 8, "g2": 0, "g3": 8}  # its own previous gang does not block it
    busy.reserve([new])  # a gang this operator decided to create
    clock[0] += 4.0
    assert free(("ml", "bert")) == {"g1": 0, "g2": 0, "g3": 0} and Kube.lists == 1
    clock[0] += 2.0  # past the ttl: listed again, but the LIST does not show the pod yet: still reserved
    assert free(("ml", "bert"))["g3"] == 0 and Kube.lists == 2 and busy.reserved
    Kube.has_new = True
    clock[0] += 6.0  # the LIST shows it: counted once, no longer reserved
    assert free(("ml", "bert"))["g3"] == 0 and Kube.lists == 3 and not busy.reserved
    Kube.has_new = False  # deleted since
    clock[0] += 6.0
    assert free(("ml", "bert"))["g3"] == 8
    busy.created(busy.reserve([new]))  # created again, and deleted before any LIST showed it
    assert free(("ml", "bert"))["g3"] == 0  # the cached LIST was sent before the creation returned: it cannot say
    clock[0] += 6.0  # a LIST sent after the creation returned lacks it (a consistent read): gone
    assert free(("ml", "bert"))["g3"] == 8 and not busy.reserved


def test_admission_with_the_index_lists_only_foreign_pods_and_reservations_end_when_the_index_shows_them(
        monkeypatch):
    """With the operator's pod index: the LIST asks only for pods without the job label (other tenants), however
    many jobs run; our pods come from the index; a reservation ends when its pod is in the index, is released by
    a failed write, or its pod's DELETED event; only a backstop of BACKSTOP_SECONDS after its creation lapses it."""
    import asyncio

    from seqtrain_operator.k8s.capacity import busy as busy_mod
    from seqtrain_operator.k8s.passes import reconcile

    class Kube:
        selectors: list[str] = []

        async def list_pods(self, namespace, label_selector="", field_selector=""):  # noqa: ANN001, ANN202
            Kube.selectors.append(label_selector)
            return [job_pod("tenant", node="g1", gpus=4, phase="Running")]

    clock = [100.0]
    monkeypatch.setattr(busy_mod.time, "monotonic", lambda: clock[0])
    nodes, busy, kube = [k8s_node("g1"), k8s_node("g2"), k8s_node("g3")], reconcile.BusyPods(ttl=5.0), Kube()
    running = job_pod("a-1-0", node="g2", gpus=8, phase="Running")
    done = job_pod("b-1-0", node="g3", gpus=8, phase="Succeeded")
    for p, job_name in ((running, "a"), (done, "b")):
        p["metadata"].update(namespace="ml", labels={"seqtrain.dev/job": job_name})
    planned = job_pod("c-1-0", pinned="g3", gpus=8)
    planned["metadata"].update(namespace="ml", labels={"seqtrain.dev/job": "c"})

    def free(ours, job_key=("ml", "d")):  # noqa: ANN001, ANN202
        return {n.name: n.gpus for n in asyncio.run(reconcile.capacity(kube, nodes, busy, job_key, ours))}

    assert free([running, done]) == {"g1": 4, "g2": 0, "g3": 8}  # a finished pod takes nothing
    assert Kube.selectors == ["!seqtrain.dev/job"]
    keys = busy.reserve([planned])
    assert free([running, done])["g3"] == 0  # not in the index yet: reserved
    assert free([running, done, planned])["g3"] == 0 and not busy.reserved  # in the index: counted once
    busy.reserve([planned])
    busy.release(keys)  # its status write lost a conflict: nothing was created
    assert free([running, done])["g3"] == 8
    keys = busy.reserve([planned])
    clock[0] += busy_mod.BACKSTOP_SECONDS + 1  # its creation is still queued: the reservation never lapses meanwhile
    assert free([running, done])["g3"] == 0
    busy.created(keys)
    clock[0] += 120.0  # created; the index lags the API by minutes (1000 jobs on two cores): still reserved
    assert free([running, done])["g3"] == 0
    busy.gone(keys[0])  # created and deleted before an admission saw it in the index: its DELETED event
    assert free([running, done])["g3"] == 8
    busy.created(busy.reserve([planned]))
    clock[0] += busy_mod.BACKSTOP_SECONDS + 1  # neither seen nor a DELETED event (missed while re-watching)
    assert free([running, done])["g3"] == 8 and Kube.selectors == ["!seqtrain.dev/job"] * 4
