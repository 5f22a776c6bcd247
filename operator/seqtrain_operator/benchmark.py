"""`seqtrain bench operator`: the operator at scale on the test control plane (scripts/testbed.sh) with kwok nodes.

Creates `--nodes` kwok nodes (simulated: kwok keeps them Ready and runs every pod bound to them), runs the
operator as its own process (`seqtrain operator`, authenticated as the chart's ServiceAccount after a real
`helm install`) behind the fault proxy of tests/testbed (no faults: it only counts the operator's requests), applies
`--jobs` SeqTrainJobs of `--replicas` pods each, and reports:

- the bare baseline first, on the same nodes: the same pods (the operator's own manifests, same requests and node
  selector, no owner) created directly, no operator, and the seconds until kube-scheduler has them all Running
  (`baseline.all_pods_running_s`): what this machine's scheduler and kwok allow at best; they are deleted before
  the operator starts;
- with `--kueue`, the same gangs admitted by Kueue (its controller manager, built by scripts/gang-schedulers.sh), on
  the same nodes, before the operator starts: each gang a plain pod group in a LocalQueue whose quota is the
  nodes' capacity; seconds until every Workload is admitted and every pod Running (`kueue.all_pods_running_s`);
- seconds from the first apply to all pods created, to all pods Running, and to every job's status Running (when
  that does not happen within `--timeout`, the result says `complete: false` and what ran by then);
- the operator process's CPU seconds and peak RSS (from /proc), over the whole run;
- the operator's API requests over the run, by verb and resource, against the budget 1.5 x (pods + 3 x jobs);
- API requests per job per minute at steady state (everything Running, over `--steady-seconds`), by verb/resource;
- p50/p99 of one reconcile pass, from the operator's `seqtrain_reconcile_seconds` histogram (interpolated within
  its buckets), over the whole run and over the steady window;
- how long the apiserver took to answer the operator's requests over the run, per kind (`apiserver_seconds`, as
  the proxy saw them): a pass that writes a status cannot be quicker than that answer.

The operator runs as users run it: progress polling on (kwok pods run no trainer, so rank 0 never answers and
every poll waits out its timeout). Needs a source checkout (scripts/testbed.sh, charts/, tests/testbed/). Uses a
running testbed, else starts one and stops it at the end. `--operator-source DIR` runs the operator of another
checkout (before/after comparisons on one testbed).

    seqtrain bench operator --out operator.json                      # 1000 jobs x 8 pods on 500 nodes
    seqtrain bench operator --jobs 50 --nodes 50 --steady-seconds 60 --out quick.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "seqtrain-bench"
POOL = "seqtrain.bench/pool"
GROUP, VERSION, PLURAL = "seqtrain.dev", "v1alpha1", "seqtrainjobs"
RELEASE, RELEASE_NS, SERVICE_ACCOUNT = "seqtrain", "seqtrain-system", "seqtrain"


def _log(msg: str) -> None:
    print(f"[bench operator {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _wait(fn: Callable[[], Any], timeout: float, what: str, interval: float = 2.0) -> Any:
    from seqtrain_operator.k8s.api.client import transient

    deadline = time.monotonic() + timeout
    while True:
        try:
            out = fn()
        except Exception as exc:
            if not transient(exc):  # the operator's own rule: a 5xx, a 429 or a dropped connection is asked again
                raise
            _log(f"{what}: the apiserver answered {(str(exc) or type(exc).__name__).splitlines()[0][:160]}; asking again")
            out = None
        if out:
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _namespace(core: Any, name: str) -> None:
    """Create namespace `name` (already there is fine) and wait for its default ServiceAccount."""
    from kubernetes import client

    try:
        core.create_namespace({"metadata": {"name": name}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    _wait(lambda: core.list_namespaced_service_account(name).items, 60, "default ServiceAccount")


def _testbed(started: list[bool]) -> str:
    script = ROOT / "scripts" / "testbed.sh"
    if not script.exists():
        raise SystemExit("seqtrain bench operator needs a source checkout (scripts/testbed.sh, charts/, tests/testbed/)")
    if subprocess.run([str(script), "status"], capture_output=True).returncode != 0:
        _log("starting the testbed (scripts/testbed.sh up)")
        # Hundreds of kwok nodes on a small machine: the tests' 10 s node-monitor grace (kwok renewing leases every
        # 3 s) would let a CPU-starved kwok miss renewals, and nodes would go NotReady and evict their pods.
        env = {"TESTBED_KWOK_LEASE_SECONDS": "40", "TESTBED_NODE_GRACE_SECONDS": "60", **os.environ}
        subprocess.run([str(script), "up"], check=True, stdout=subprocess.DEVNULL, env=env)
        started.append(True)
    return str(Path(os.environ.get("TESTBED_DIR") or ROOT / ".testbed") / "kubeconfig")


def _node(name: str, cpu: int, memory_gi: int) -> dict[str, Any]:
    capacity = {"cpu": str(cpu), "memory": f"{memory_gi}Gi", "pods": "110", "ephemeral-storage": "500Gi"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                         "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                    POOL: "bench"}},
            "spec": {},
            "status": {"capacity": capacity, "allocatable": capacity}}


def _job(name: str, replicas: int) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SeqTrainJob", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": replicas, "resources": {"gpus": 0, "cpu": "1", "memory": "1Gi"},
                     "training": {"steps": 1000000, "globalBatchSize": replicas, "microBatchSize": 1},
                     # The operator's throughput is what is measured. On a small machine kwok and the watch fall
                     # minutes behind a burst of 8000 pods: pods look pending long after they were bound, and the
                     # default 300 s grace would tear gangs down and re-create them (measuring the churn instead).
                     "scheduling": {"topology": {"policy": "none"}, "nodeSelector": {POOL: "bench"},
                                    "pendingGraceSeconds": 3600}}}


def _proc_cpu_rss(pid: int) -> tuple[float, float]:
    """(CPU seconds user+system, peak RSS MiB) of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    hwm = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    return cpu, hwm / 1024


def _rss_now(pid: int) -> float | None:
    """Current RSS MiB of a live process (the progress log's trajectory: a peak from a burst or a steady level)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) / 1024 for line in text.splitlines() if line.startswith("VmRSS:")), None)


def _histogram(url: str) -> list[tuple[float, float]]:
    """The cumulative buckets (upper bound, count) of seqtrain_reconcile_seconds."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out = []
    for m in re.finditer(r'^seqtrain_reconcile_seconds_bucket\{le="([^"]+)"\} ([0-9.e+]+)$', text, re.M):
        out.append((float(m.group(1)), float(m.group(2))))
    return sorted(out)


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a cumulative Prometheus histogram, linear within the bucket (as histogram_quantile)."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lo  # beyond the largest finite bucket: its bound is all that is known
            return lo + (le - lo) * ((rank - below) / (count - below) if count > below else 1.0)
        lo, below = le, count
    return lo


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    before = dict(b)
    return [(le, c - before.get(le, 0.0)) for le, c in a]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqtrain bench operator", description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=8, help="pods per job")
    p.add_argument("--nodes", type=int, default=500, help="kwok nodes (32 CPU, 256 GiB each)")
    p.add_argument("--steady-seconds", type=float, default=180.0, help="window for the steady-state request rate")
    p.add_argument("--timeout", type=float, default=7200.0, help="give up waiting for pods after this many seconds")
    p.add_argument("--keep", action="store_true", help="leave the jobs and nodes in the cluster")
    p.add_argument("--no-baseline", action="store_true", help="skip the bare baseline (pods created directly)")
    p.add_argument("--kueue", action="store_true",
                   help="also time the same gangs admitted by Kueue (pod groups; needs scripts/gang-schedulers.sh)")
    p.add_argument("--operator-source", metavar="DIR", help="run the operator of this checkout (default: this one)")
    p.add_argument("--out", help="write the JSON here (default: stdout)")
    p.add_argument("--requests-log", metavar="FILE",
                   help="also write every API request of the run (verb, path, status, body) as JSON lines")
    args = p.parse_args(list(argv) if argv is not None else None)
    for name in ("jobs", "replicas", "nodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")

    import yaml
    from kubernetes import client, config

    sys.path.insert(0, str(ROOT / "tests"))
    from testbed.faultproxy import FaultProxy  # test infrastructure of the checkout

    started: list[bool] = []
    kubeconfig = _testbed(started)
    api = config.new_client_from_config(config_file=kubeconfig)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    tmp = Path(tempfile.mkdtemp(prefix="seqtrain-bench-operator-"))
    result: dict[str, Any] = {"benchmark": "operator", "command": "seqtrain bench operator " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "date": dt.date.today().isoformat(), "machine": {
                                  "cpus": os.cpu_count(), "platform": platform.platform(),
                                  "python": platform.python_version()},
                              "jobs": args.jobs, "replicas": args.replicas, "pods": args.jobs * args.replicas,
                              "nodes": args.nodes}
    op = proxy = None
    try:
        helm = str(ROOT / ".tools" / "bin" / "helm") if (ROOT / ".tools" / "bin" / "helm").exists() else "helm"
        subprocess.run([helm, "upgrade", "--install", RELEASE, str(ROOT / "charts" / "seqtrain"), "-n", RELEASE_NS,
                        "--create-namespace", "--kubeconfig", kubeconfig, "--set", "replicaCount=0", "--set", "fullnameOverride=seqtrain",
                        "--set", "webhook.enabled=false", "--set", "metrics.enabled=false", "--wait"],
                       check=True, capture_output=True)
        with ThreadPoolExecutor(8) as pool:
            _log(f"creating {args.nodes} kwok nodes")
            existing = {n.metadata.name for n in core.list_node(label_selector=f"{POOL}=bench").items}
            list(pool.map(lambda i: core.create_node(_node(f"bench-{i:04d}", 32, 256)),
                          [i for i in range(args.nodes) if f"bench-{i:04d}" not in existing]))
            _wait(lambda: sum(any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
                              for n in core.list_node(label_selector=f"{POOL}=bench").items) >= args.nodes,
                  600, "kwok nodes Ready")
            _namespace(core, NAMESPACE)

            if not args.no_baseline:
                result["baseline"] = _baseline(api, pool, args.jobs, args.replicas, args.timeout)
            if args.kueue:
                result["kueue"] = _kueue(api, pool, kubeconfig, args.jobs, args.replicas, args.nodes, args.timeout)

            cp_cfg = yaml.safe_load(Path(kubeconfig).read_text())
            server = cp_cfg["clusters"][0]["cluster"]["server"]
            ca = cp_cfg["clusters"][0]["cluster"].get("certificate-authority")
            proxy = FaultProxy(upstream=server, ca_file=ca).start()
            token = core.create_namespaced_service_account_token(SERVICE_ACCOUNT, RELEASE_NS, {
                "spec": {"expirationSeconds": 86400}}).status.token
            from seqtrain.runtime.launch import free_port

            metrics_port = free_port()
            src = Path(args.operator_source).resolve() if args.operator_source else ROOT
            env = {**os.environ, "KUBECONFIG": proxy.kubeconfig(str(tmp / "operator.kubeconfig"), token=token),
                   "PYTHONPATH": os.pathsep.join([str(src / "trainer"), str(src / "operator")])}
            log = open(tmp / "operator.log", "wb")  # noqa: SIM115 - closed with the process
            result["operator_source"] = str(src)
            op = subprocess.Popen([sys.executable, "-m", "seqtrain_operator.cli", "operator", "--standalone", "-A",
                                   f"--metrics-port={metrics_port}"], env=env, stdout=log, stderr=subprocess.STDOUT)
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            _wait(lambda: _try(lambda: _histogram(metrics_url)) is not None, 120, "operator metrics endpoint", 0.5)
            _log(f"operator pid {op.pid}, log {tmp / 'operator.log'}; applying {args.jobs} jobs")

            t0 = time.monotonic()
            run_since = time.monotonic()
            list(pool.map(lambda i: custom.create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL, _job(f"j{i:05d}", args.replicas)), range(args.jobs)))
            result["apply_s"] = round(time.monotonic() - t0, 1)
            want = args.jobs * args.replicas
            marks: dict[str, float] = {}

            def progress() -> bool:
                pods = _pods(api, NAMESPACE)
                running = sum(1 for ph in pods if ph == "Running")
                now = time.monotonic() - t0
                if len(pods) >= want and "all_pods_created_s" not in marks:
                    marks["all_pods_created_s"] = now
                if running >= want and "all_pods_running_s" not in marks:
                    marks["all_pods_running_s"] = now
                phases = Counter((j.get("status") or {}).get("phase", "-") for j in custom.list_namespaced_custom_object(
                    GROUP, VERSION, NAMESPACE, PLURAL)["items"])
                if phases.get("Running", 0) >= args.jobs and "all_jobs_running_s" not in marks:
                    marks["all_jobs_running_s"] = now
                rss = _rss_now(op.pid)
                _log(f"t={now:.0f}s pods {len(pods)}/{want}, running {running}; jobs {dict(phases)}"
                     + (f"; operator RSS {rss:.0f} MiB" if rss is not None else ""))
                return len(marks) == 3

            try:
                _wait(progress, args.timeout, "every pod Running and every job Running", interval=5.0)
                result["complete"] = True
            except TimeoutError as exc:  # measured as it is: what ran by then, and the steady state of that
                result["complete"] = False
                result["incomplete"] = f"{exc} (after --timeout {args.timeout:.0f}s)"
            result.update({k: round(v, 1) for k, v in marks.items()})
            phases = [_pods(api, NAMESPACE)]
            result["pods_running_at_end_of_wait"] = sum(1 for ph in phases[0] if ph == "Running")
            result["pods_at_end_of_wait"] = len(phases[0])
            run = proxy.requests(since=run_since)
            result["run_requests"] = {"total": len(run), "budget": int(1.5 * (want + 3 * args.jobs)),
                                      "by_request": dict(Counter(_kind(r) for r in run).most_common()),
                                      "by_status": dict(Counter(str(r.status) for r in run).most_common())}
            result["apiserver_seconds"] = answer_times(run)

            _log(f"steady state for {args.steady_seconds:.0f}s")
            h0, since = _histogram(metrics_url), time.monotonic()
            time.sleep(args.steady_seconds)
            window = time.monotonic() - since
            h1 = _histogram(metrics_url)
            reqs = proxy.requests(since=since)
            kinds = Counter(_kind(r) for r in reqs)
            result["steady"] = {"window_s": round(window, 1), "requests": len(reqs),
                                "requests_per_job_per_minute": round(len(reqs) / args.jobs / (window / 60), 2),
                                "by_request": dict(kinds.most_common())}
            steady = _minus(h1, h0)
            result["reconcile_seconds"] = {
                "whole_run": {"passes": int(h1[-1][1]) if h1 else 0, "p50": quantile(h1, 0.5), "p99": quantile(h1, 0.99)},
                "steady": {"passes": int(steady[-1][1]) if steady else 0, "p50": quantile(steady, 0.5),
                           "p99": quantile(steady, 0.99)},
                "buckets": [le for le, _ in h1]}
            cpu, rss = _proc_cpu_rss(op.pid)
            result["operator"] = {"cpu_seconds": round(cpu, 1), "peak_rss_mib": round(rss, 1),
                                  "requests_total": proxy.count()}
            if args.requests_log:  # what each request was for (which PATCH, which GET): the figures' explanation
                with open(args.requests_log, "w", encoding="utf-8") as f:
                    for r in proxy.requests(since=run_since):
                        f.write(json.dumps({"at": round(r.at - run_since, 3), "method": r.method, "path": r.path,
                                            "query": r.query, "status": r.status, "agent": r.user_agent,
                                            "body": r.body}) + "\n")
            if args.out:  # now, not after the clean-up: deleting 8000 pods can take longer than the run
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        if not args.keep and not started:  # a testbed this run started goes down with everything in it
            _log("deleting the jobs (the operator releases their finalizers), the namespace and the nodes")
            _wait(lambda: _delete_jobs(custom), 1800, "jobs deleted", 5.0)
            core.delete_namespace(NAMESPACE)
            core.delete_collection_node(label_selector=f"{POOL}=bench")
    finally:
        if op is not None:
            op.terminate()
            try:
                op.wait(30)
            except subprocess.TimeoutExpired:
                op.kill()
        if proxy is not None:
            proxy.stop()
        if started and not args.keep:
            subprocess.run([str(ROOT / "scripts" / "testbed.sh"), "down"], check=False, stdout=subprocess.DEVNULL)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def answer_times(records: Sequence[Any], least: int = 100) -> dict[str, dict[str, float]]:
    """Per kind of request (at least `least` of them, watches left out): how long the apiserver took to answer the
    operator's requests, as the proxy in front of it saw (p50, p99, max). A reconcile pass that writes a status
    waits at least this: the floor the machine puts under the pass's own time."""
    times: dict[str, list[float]] = {}
    for r in records:
        if not r.watch and r.answered is not None:
            times.setdefault(_kind(r), []).append(r.answered - r.at)
    out = {}
    for kind, ts in sorted(times.items()):
        if len(ts) >= least:
            ts.sort()
            out[kind] = {"n": len(ts), "p50": round(ts[len(ts) // 2], 4),
                         "p99": round(ts[min(len(ts) - 1, int(0.99 * len(ts)))], 4), "max": round(ts[-1], 4)}
    return out


def _kind(r: Any) -> str:
    """A recorded request as `VERB resource` (`GET watch pods`)."""
    return f"{r.method}{' watch' if r.watch else ''} {_resource(r.path)}"


def _bare_pods(jobs: int, replicas: int, ns: str, prefix: str) -> list[list[dict[str, Any]]]:
    """The operator's gangs' pods (its own manifests: same requests, node selector, everything), without an owner,
    one list per gang, named `<prefix><job>-<replica>`."""
    from seqtrain.spec import parse_job
    from seqtrain_operator.k8s.owner import Owner
    from seqtrain_operator.k8s.pods import manifests as m

    spec = parse_job({**_job("b", replicas), "metadata": {"name": "b", "namespace": ns}})
    template = m.build_gang(spec, Owner("b", ns, "00000000-0000-0000-0000-000000000000"), 1, m.Settings(),
                            None).pods
    gangs = []
    for j in range(jobs):
        gang = []
        for r, tpl in enumerate(template):
            pod = json.loads(json.dumps(tpl))
            meta = pod["metadata"]
            meta.pop("ownerReferences", None)
            meta["name"] = f"{prefix}{j:05d}-{r}"
            meta["labels"] = {}
            gang.append(pod)
        gangs.append(gang)
    return gangs


def _baseline(api: Any, pool: ThreadPoolExecutor, jobs: int, replicas: int, timeout: float) -> dict[str, Any]:
    """The same pods as the operator's gangs, created directly (no operator, no owner), in their own namespace:
    seconds until kube-scheduler has them all Running; then they are deleted and gone before the operator runs."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    ns = NAMESPACE + "-baseline"
    _namespace(core, ns)
    pods = [pod for gang in _bare_pods(jobs, replicas, ns, "b") for pod in gang]
    for pod in pods:
        pod["metadata"]["labels"] = {"seqtrain.bench/baseline": "true"}
    want = len(pods)
    _log(f"baseline: creating {want} pods directly (no operator)")
    t0 = time.monotonic()
    list(pool.map(lambda pod: core.create_namespaced_pod(ns, pod, _preload_content=False), pods))
    created = time.monotonic() - t0

    def running() -> bool:
        phases = _pods(api, ns)
        done = sum(1 for ph in phases if ph == "Running")
        _log(f"baseline t={time.monotonic() - t0:.0f}s running {done}/{want}")
        return done >= want

    _wait(running, timeout, "every baseline pod Running", interval=5.0)  # as the operator run polls
    out = {"pods": want, "all_pods_created_s": round(created, 1), "all_pods_running_s": round(time.monotonic() - t0, 1)}
    core.delete_collection_namespaced_pod(ns, grace_period_seconds=0, _preload_content=False, _request_timeout=300)
    _wait(lambda: not _pods(api, ns), 1800, "baseline pods deleted", 5.0)
    return out


KUEUE_LABEL = "seqtrain.bench/kueue"  # the pods Kueue's pod webhooks see (testbed.gangs.kueue's objectSelector)


def _kueue(api: Any, pool: ThreadPoolExecutor, kubeconfig: str, jobs: int, replicas: int, nodes: int,
           timeout: float) -> dict[str, Any]:
    """The same gangs admitted by Kueue (v0.19, its own controller manager with its default client settings):
    each gang a plain pod group (KEP-976: queue and group labels, the group's size) in a LocalQueue whose
    ClusterQueue's quota is the kwok nodes' capacity, so quota never holds a gang back and the figure is Kueue's
    admission plus kube-scheduler. Seconds until every pod is Running, and until every Workload is admitted; the
    pods (their Kueue finalizers taken off) and Workloads are then deleted and Kueue stopped, before the operator
    runs."""
    from kubernetes import client

    from testbed import gangs
    from testbed.fixtures import Testbed

    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    tb = Testbed(kubeconfig=Path(kubeconfig))
    ns = NAMESPACE + "-kueue"
    _namespace(core, ns)
    built = subprocess.run([str(ROOT / "scripts" / "gang-schedulers.sh"), "--check", "kueue"], capture_output=True,
                           text=True).stdout.strip()  # .../gang-kueue-<version>-scheduler-plugins-<version>
    version = re.search(r"kueue-(v[0-9.]+)", built)
    out: dict[str, Any] = {"kueue": version.group(1) if version else None, "pods": jobs * replicas,
                           "client": "Kueue's defaults (its Configuration sets no clientConnection: v0.19's "
                                     "defaults are 300 QPS, burst 500)"}
    with gangs.kueue(tb, pod_label=KUEUE_LABEL):
        tb.apply([
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "bench"},
             "spec": {"nodeLabels": {POOL: "bench"}}},
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "bench"},
             "spec": {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
                 {"name": "bench", "resources": [{"name": "cpu", "nominalQuota": str(32 * nodes)},
                                                 {"name": "memory", "nominalQuota": f"{256 * nodes}Gi"}]}]}]}},
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "bench", "namespace": ns},
             "spec": {"clusterQueue": "bench"}}])
        pods = []
        for j, gang in enumerate(_bare_pods(jobs, replicas, ns, "k")):
            for pod in gang:
                pod["metadata"]["labels"] = {KUEUE_LABEL: "true", "kueue.x-k8s.io/queue-name": "bench",
                                             "kueue.x-k8s.io/pod-group-name": f"k{j:05d}"}
                pod["metadata"]["annotations"] = {"kueue.x-k8s.io/pod-group-total-count": str(replicas)}
                pods.append(pod)
        want = len(pods)
        _log(f"kueue: creating {jobs} pod groups of {replicas} ({want} pods) in LocalQueue bench")
        t0 = time.monotonic()
        list(pool.map(lambda pod: core.create_namespaced_pod(ns, pod, _preload_content=False), pods))
        out["all_pods_created_s"] = round(time.monotonic() - t0, 1)
        marks: dict[str, float] = {}

        def done() -> bool:
            phases = _pods(api, ns)
            running = sum(1 for ph in phases if ph == "Running")
            workloads = custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", ns, "workloads")["items"]
            admitted = sum(1 for w in workloads if (w.get("status") or {}).get("admission"))
            now = time.monotonic() - t0
            if admitted >= jobs and "all_workloads_admitted_s" not in marks:
                marks["all_workloads_admitted_s"] = now
            if running >= want and "all_pods_running_s" not in marks:
                marks["all_pods_running_s"] = now
            _log(f"kueue t={now:.0f}s workloads {len(workloads)}, admitted {admitted}/{jobs}; running {running}/{want}")
            return len(marks) == 2

        try:
            _wait(done, timeout, "every Kueue workload admitted and every pod Running", interval=5.0)
            out["complete"] = True
        except TimeoutError as exc:
            out.update(complete=False, incomplete=f"{exc} (after --timeout {timeout:.0f}s)")
        out.update({k: round(v, 1) for k, v in marks.items()})
        _log("kueue: deleting its pods and workloads")
        core.delete_collection_namespaced_pod(ns, grace_period_seconds=0, _preload_content=False,
                                              _request_timeout=300)
        # Kueue keeps its finalizer on a group's pods while their Workload is active (a deleted pod of a running
        # group is a failure it accounts for): the clean-up takes it off, as nothing of the run is measured now.
        names = [p["metadata"]["name"] for p in json.loads(core.list_namespaced_pod(
            ns, _preload_content=False, _request_timeout=120).data)["items"]]
        list(pool.map(lambda name: _try_api(lambda: core.patch_namespaced_pod(
            name, ns, {"metadata": {"finalizers": None}}, _preload_content=False)), names))
        custom.delete_collection_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", ns, "workloads")
        _wait(lambda: not _pods(api, ns), 600, "Kueue's pods deleted", 5.0)
    return out


def _delete_jobs(custom: Any) -> bool:
    """One DELETE of the collection; True once no job is left. 1000 jobs can outlast the server's 60 s request
    timeout (a 504): what it deleted stays deleted, and the next call goes on."""
    from kubernetes.client.exceptions import ApiException

    try:
        custom.delete_collection_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
    except ApiException as exc:
        if exc.status not in (500, 504):
            raise
    return not custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)["items"]


def _pods(api: Any, namespace: str) -> list[str]:
    """Phases of the namespace's pods (one LIST, decoded without building client objects)."""
    from kubernetes import client

    resp = client.CoreV1Api(api).list_namespaced_pod(namespace, _preload_content=False, _request_timeout=120)
    return [(p.get("status") or {}).get("phase", "") for p in json.loads(resp.data)["items"]]


def _resource(path: str) -> str:
    """/api/v1/namespaces/x/pods/y/status -> pods/status; /apis/g/v/namespaces/x/kind -> kind."""
    parts = [p for p in path.split("/") if p]
    parts = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if parts[:1] == ["namespaces"] and len(parts) >= 3:
        parts = parts[2:]
    return "/".join([parts[0], *parts[2:]]) if parts else path


def _try_api(fn: Callable[[], Any]) -> Any:
    """`fn()`, or None when the object is already gone (404)."""
    from kubernetes.client.exceptions import ApiException

    try:
        return fn()
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except OSError:
        return None

