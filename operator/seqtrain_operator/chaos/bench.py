"""`seqtrain bench chaos`: random faults over many jobs on the test control plane, with invariants checked all the
time; the reliability figure of docs/benchmarks.md ("Chaos soak").

Starts (or reuses) the control plane of scripts/testbed.sh, installs the chart and runs the operator as a local
process behind the fault proxy of tests/testbed (as `seqtrain bench operator` and the integration tests do), then:

- runs one uninterrupted reference job (the soak's trainer spec) for the exact-resume comparison;
- keeps `--jobs` real trainer jobs (tiny GPT on the node agent's CPU nodes, frequent checkpoints on a shared
  volume: a tmpfs of its own when run as root, so the volume can be filled) and `--load-jobs` admission-only jobs
  (GPU pods on kwok nodes, deleted after a while) running for `--minutes`;
- fires the seeded schedule of chaos.schedule (every event, injected or skipped, with the job it hit, goes to
  `<out>.events.jsonl`), and checks chaos.invariants on every round of observation;
- at the end heals what is still broken, waits for every trainer job to end (each within its own deadline),
  deletes every job and checks that no pod is left.

    seqtrain bench chaos --seed 1 --minutes 60 --out chaos.json
    seqtrain bench chaos --seed 1 --minutes 3 --rates sigkill-rank=120,node-down=0 --out short.json

Exit status 0 when no invariant was violated, 1 otherwise (the JSON says which, when and on which job).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seqtrain_operator.chaos import schedule
from seqtrain_operator.chaos.inject import NAN_TRIGGER, Injector, Skip
from seqtrain_operator.chaos.invariants import TERMINAL, Checker, Deadlines, stuck_after

ROOT = Path(__file__).resolve().parents[3]
GROUP, VERSION, PLURAL = "seqtrain.dev", "v1alpha1", "seqtrainjobs"
CHECK_INTERVAL = 3.0  # seconds between rounds of observation
DEFER_S = 60.0  # how long a rank or checkpoint event waits for a gang that trains
TERMINATION_GRACE, NODE_LOST_GRACE = 30.0, 40.0  # the operator's options as tests/testbed/fixtures.py starts it


def _log(msg: str) -> None:
    print(f"[chaos {dt.datetime.now(dt.timezone.utc):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def trainer_spec(steps: int, interval: int) -> dict[str, Any]:
    """The soak's trainer job: examples/k8s-cpu.yaml's model and data, on the agent's nodes, a checkpoint every
    `interval` steps; a hang is detected (a SIGSTOPped rank never continued) and restarts back off briefly."""
    return {"replicas": 2,
            "resources": {"gpus": 0, "cpu": "500m", "memory": "1Gi", "shmSize": "256Mi"},
            "model": {"arch": "gpt", "preset": "tiny"},
            "data": {"source": "builtin", "seqLen": 64},
            "training": {"steps": steps, "globalBatchSize": 8, "microBatchSize": 4},
            "checkpoint": {"intervalSteps": interval, "keep": 3, "pvc": "seqtrain-ckpt"},
            "faultTolerance": {"maxRestarts": 4, "maxInfraRestarts": 20, "backoffSeconds": 2,
                               "maxBackoffSeconds": 20, "hangTimeoutSeconds": 120},
            "scheduling": {"nodeSelector": {"seqtrain.dev/testbed-agent": "true"}, "topology": {"policy": "none"}}}


def load_spec() -> dict[str, Any]:
    """An admission-only job: one GPU pod on a kwok node (it never trains; it loads the operator and the API)."""
    return {"replicas": 2, "resources": {"gpus": 1, "cpu": "1", "memory": "1Gi"},
            "training": {"steps": 1000000, "globalBatchSize": 2, "microBatchSize": 1},
            "scheduling": {"nodeSelector": {"type": "kwok"}, "topology": {"policy": "none"}}}


def chart_memory_limit() -> int | None:
    """The operator container's memory limit in bytes as the chart renders it with its defaults."""
    import yaml

    from seqtrain_operator.planner.inventory import memory_bytes
    helm = shutil.which("helm") or str(ROOT / ".tools" / "bin" / "helm")
    out = subprocess.run([helm, "template", "seqtrain", str(ROOT / "charts" / "seqtrain")], capture_output=True,
                         text=True, check=False)
    for doc in yaml.safe_load_all(out.stdout or ""):
        if doc and doc.get("kind") == "Deployment":
            limit = ((doc["spec"]["template"]["spec"]["containers"][0].get("resources") or {}).get("limits") or {})
            return memory_bytes(limit["memory"]) if "memory" in limit else None
    return None


class World:
    """What the soak runs and observes: the testbed, the operator, the proxy, the jobs and their pods."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        from kubernetes import client, config

        from testbed import fixtures
        from testbed.faultproxy import FaultProxy
        self.args, self.out = args, out
        self.fx = fixtures
        self.tb_dir = fixtures.TB
        self.started_testbed = False
        kubeconfig = self._testbed()
        self.tb = fixtures.Testbed(Path(kubeconfig), {"SEQTRAIN_K8S_BIN": os.environ.get("SEQTRAIN_K8S_BIN", "")})
        api = config.new_client_from_config(config_file=kubeconfig)
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.proxy = FaultProxy(upstream=self.tb.server(), ca_file=str(self.tb_dir / "pki" / "ca.crt")).start()
        source = Path(args.operator_source).resolve() if args.operator_source else ROOT
        self.op = fixtures.Operator(self.tb, fixtures.free_port(), proxy=self.proxy, source=source,
                                    log=out.with_suffix(".operator.log"))
        self.op_lock = threading.Lock()
        self.op_pids: list[int] = []
        self.peak_rss = 0
        self.checker = Checker(Deadlines(TERMINATION_GRACE, NODE_LOST_GRACE, CHECK_INTERVAL))
        self.ns = self.load_ns = ""
        self.volume = Path()
        self.volume_is_tmpfs = False
        self.snapshot: dict[str, Any] = {"jobs": [], "pods": []}
        self.log_offsets: dict[str, int] = {}
        self.oplog_offset = 0
        self.proxy_seen = 0
        self.t0 = time.monotonic()
        self.injector = Injector(self, self.tb_dir, ROOT / "scripts" / "testbed.sh")

    # ---- set-up and tear-down ------------------------------------------------------------------------------

    def _testbed(self) -> str:
        script = ROOT / "scripts" / "testbed.sh"
        if subprocess.run([str(script), "status"], capture_output=True, check=False).returncode != 0:
            _log("starting the testbed (scripts/testbed.sh up)")
            self.started_testbed = True
        out = subprocess.run([str(script), "up"], capture_output=True, text=True, check=False, timeout=900)
        if out.returncode != 0:
            raise SystemExit(f"seqtrain bench chaos: scripts/testbed.sh up failed: {out.stderr[-2000:]}")
        return [x for x in out.stdout.splitlines() if x.startswith("KUBECONFIG=")][-1].split("=", 1)[1]

    def setup(self) -> None:
        self.op.install()
        self.start_operator()
        self.ns = self.tb.checkpoint_namespace("chaos")
        self.volume = self.tb_dir / "volumes" / self.ns
        if os.geteuid() == 0:  # a filesystem of its own, so checkpoint-full can fill it without filling /tmp
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.volume_mib}m", "chaos-ckpt",
                                   str(self.volume)], capture_output=True, text=True, check=False)
            self.volume_is_tmpfs = done.returncode == 0
            if not self.volume_is_tmpfs:
                _log(f"no tmpfs for the checkpoint volume ({done.stderr.strip()}): checkpoint-full is skipped")
        self.load_ns = self.tb.namespace("chaos-load")

    def teardown(self) -> None:
        # The namespaces go while the operator still runs: it releases its jobs' finalizers.
        self.proxy.clear_rules()
        for ns in (self.ns, self.load_ns):
            if ns:
                with contextlib.suppress(Exception):  # a slow deletion: the namespace goes on going without us
                    self.tb.kubectl("delete", "namespace", ns, "--timeout=180s", check=False, timeout=240)
        with contextlib.suppress(Exception):
            self.op.stop()
        self.proxy.stop()
        if self.volume_is_tmpfs:
            subprocess.run(["umount", "-l", str(self.volume)], check=False, capture_output=True)
        if self.started_testbed and not self.args.keep_testbed:
            subprocess.run([str(ROOT / "scripts" / "testbed.sh"), "down"], check=False, capture_output=True)

    # ---- the operator --------------------------------------------------------------------------------------

    def start_operator(self) -> None:
        self.op.start()
        assert self.op.proc is not None
        self.op_pids.append(self.op.proc.pid)
        self.checker.fault(None, "operator-start", self.now())

    def restart_operator(self, graceful: bool) -> None:
        with self.op_lock:
            if graceful:
                self.op.stop()
            elif self.op.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.op.proc.pid, signal.SIGKILL)
                self.op.proc.wait(30)
            self.start_operator()

    def sample_rss(self) -> None:
        if self.op.proc is None:
            return
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.op.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_rss = max(self.peak_rss, int(line.split()[1]) * 1024)

    # ---- jobs ----------------------------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def submit(self, name: str, kind: str, spec: dict[str, Any]) -> None:
        ns = self.load_ns if kind == "load" else self.ns
        if kind != "load":  # rank 0 watches for the nan-loss injector's file in the job's folder on the volume
            env = [{"name": "SEQTRAIN_FAULT_NAN_FILE", "value": f"/checkpoints/{name}/{NAN_TRIGGER}"}]
            spec = {**spec, "podTemplate": {"spec": {"containers": [{"name": "trainer", "env": env}]}}}
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SeqTrainJob", "metadata": {"name": name}, "spec": spec}
        deadline = time.monotonic() + 300
        while True:  # the webhook refuses while the operator restarts (failurePolicy Fail): a user retries
            try:
                self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
                break
            except Exception as exc:  # noqa: BLE001 (any refusal: retried until the deadline)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not create {name}: {exc}") from exc
                time.sleep(2)
        self.checker.add_job(name, kind, spec, self.now())

    def delete_job(self, name: str, kind: str) -> None:
        ns = self.load_ns if kind == "load" else self.ns
        with contextlib.suppress(Exception):
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        self.checker.jobs[name].deleted_at = self.now()

    def observe(self) -> None:
        """One round of observation; feeds the checker."""
        from kubernetes.client import ApiClient
        sanitize = ApiClient().sanitize_for_serialization
        objects = []
        for ns in (self.ns, self.load_ns):
            objects += self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
        pods = []
        for ns in (self.ns, self.load_ns):
            pods += [sanitize(p) for p in self.core.list_namespaced_pod(ns).items]
        self.snapshot = {"jobs": objects, "pods": pods}
        start_lines: dict[str, list[str]] = {}
        for pod in pods:  # rank 0's log: its start lines (resumed from which step)
            labels = pod["metadata"].get("labels") or {}
            job = labels.get("seqtrain.dev/job")
            if job is None or labels.get("seqtrain.dev/replica") != "0" or pod["metadata"]["namespace"] != self.ns:
                continue
            start_lines.setdefault(job, []).extend(self._new_lines(pod["metadata"]["uid"]))
        checkpoints = {name: self.checkpoints(name) for name, t in self.checker.tracks() if t.kind != "load"}
        self.checker.observe(self.now(), objects, pods, checkpoints, start_lines, set(self.injector.down))
        self.sample_rss()
        self._operator_log()
        self._status_writes()

    def _new_lines(self, uid: str) -> list[str]:
        path = self.tb_dir / "agent" / "pods" / uid / "container.log"
        try:
            with open(path, "rb") as f:
                f.seek(self.log_offsets.get(uid, 0))
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.log_offsets[uid] = self.log_offsets.get(uid, 0) + len(complete)
        return complete.decode(errors="replace").splitlines()

    def _operator_log(self) -> None:
        try:
            with open(self.op.log, "rb") as f:
                f.seek(self.oplog_offset)
                data = f.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self.oplog_offset += len(complete)
        lines = complete.decode(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "Traceback (most recent call last)" in line:
                tail = next((x for x in lines[i + 1:] if x and not x.startswith((" ", "Traceback"))), "")
                self.checker.violate(self.now(), "-", "operator traceback", tail[:300] or line)

    def _status_writes(self) -> None:
        recs = self.proxy.requests()
        for r in recs[self.proxy_seen:]:
            if (r.method == "PATCH" and r.path.endswith("/status") and "/seqtrainjobs/" in r.path and not r.injected
                    and 400 <= r.status < 500 and r.status not in (404, 409)):
                self.checker.violate(self.now(), r.path.split("/")[-2], "status write refused",
                                      f"PATCH {r.path} answered {r.status}")
        self.proxy_seen = len(recs)

    def checkpoints(self, job: str) -> set[int]:
        folder = self.volume / job / "checkpoints"
        with contextlib.suppress(OSError):
            return {int(m.group(1)) for e in os.scandir(folder) if (m := re.fullmatch(r"step-(\d+)", e.name))}
        return set()

    def _pod_view(self, pod: dict[str, Any]) -> dict[str, Any]:
        meta = pod["metadata"]
        pgid = self.tb_dir / "agent" / "pods" / meta["uid"] / "pgid"
        view = {"name": meta["name"], "namespace": meta["namespace"], "node": pod["spec"].get("nodeName")}
        with contextlib.suppress(OSError, ValueError):
            view["pgid"] = int(pgid.read_text())
        return view

    def all_pods(self) -> list[tuple[str, dict[str, Any]]]:
        """Pods of the soak's jobs that have not ended (what a lost node takes down)."""
        return [((p["metadata"].get("labels") or {}).get("seqtrain.dev/job", ""), self._pod_view(p))
                for p in self.snapshot["pods"] if (p.get("status") or {}).get("phase") not in TERMINAL]

    def running_pods(self) -> list[tuple[str, dict[str, Any]]]:
        """Running pods of the soak's jobs (not the reference's), not being deleted."""
        out = []
        for p in self.snapshot["pods"]:
            job = (p["metadata"].get("labels") or {}).get("seqtrain.dev/job", "")
            track = self.checker.jobs.get(job)
            if (track is not None and track.kind != "reference" and (p.get("status") or {}).get("phase") == "Running"
                    and not p["metadata"].get("deletionTimestamp")):
                out.append((job, self._pod_view(p)))
        return out

    def trainer_pods(self) -> list[tuple[str, dict[str, Any]]]:
        return [(j, p) for j, p in self.running_pods() if self.checker.jobs[j].kind == "trainer"
                and p["namespace"] == self.ns]

    def node_up(self, node: str) -> None:
        self.tb.kubectl("taint", "node", node, "node.kubernetes.io/out-of-service-", check=False)
        self.checker.fault(None, "node-up", self.now())


def _losses(path: Path) -> tuple[dict[int, float], int]:
    """step -> loss (the last record of a step: a resumed run writes the steps after its checkpoint again)."""
    out: dict[int, float] = {}
    twice = 0
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                rec = json.loads(line)
                twice += rec["step"] in out
                out[rec["step"]] = rec["loss"]
    return out, twice


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="seqtrain bench chaos", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: a random one, printed)")
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected")
    p.add_argument("--jobs", type=int, default=1,
                   help="real trainer jobs at once (more than 1: their ranks clash here, where every pod shares the "
                   "host's network and the operator gives every job the same rendezvous port)")
    p.add_argument("--load-jobs", type=int, default=4, help="admission-only jobs (kwok nodes) at once")
    p.add_argument("--steps", type=int, default=150, help="steps of each trainer job")
    p.add_argument("--interval", type=int, default=10, help="checkpoint interval (steps) of each trainer job")
    p.add_argument("--rates", default="", help="faults per hour by kind, e.g. sigkill-rank=120,node-down=0 "
                   f"(kinds: {', '.join(schedule.KINDS)})")
    p.add_argument("--volume-mib", type=int, default=1024, help="size of the checkpoint tmpfs (root only)")
    p.add_argument("--reference", metavar="METRICS_JSONL",
                   help="the losses of an uninterrupted run of the same --steps (an earlier soak's "
                   "<out>.reference.jsonl) instead of running the reference job")
    p.add_argument("--operator-source", metavar="DIR", help="run the operator of this checkout (default: this one)")
    p.add_argument("--keep-testbed", action="store_true", help="leave a testbed this run started up")
    p.add_argument("--out", default="chaos.json", help="the JSON figure (events: <out>.events.jsonl)")
    args = p.parse_args(list(argv) if argv is not None else None)
    try:
        rates = schedule.parse_rates(args.rates)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("jobs", "steps", "interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.minutes <= 0:
        p.error("--minutes must be more than 0")
    if args.reference:
        got, _ = _losses(Path(args.reference))
        if sorted(got) != list(range(1, args.steps + 1)):
            p.error(f"--reference: {args.reference} holds {len(got)} steps, not steps 1..{args.steps} of an "
                    "uninterrupted run (run without --reference, or with the same --steps)")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    _log(f"seed {seed} (reproduce: seqtrain bench chaos --seed {seed} ...)")
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    events = schedule.build(seed, args.minutes * 60, rates)
    world = World(args, out)
    result: dict[str, Any] = {
        "benchmark": "chaos", "seed": seed,
        "command": "seqtrain bench chaos " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_at_start": os.getloadavg()[0]},
        "minutes": args.minutes, "rates_per_hour": {k: r for k, (_, r) in schedule.KINDS.items()} | rates,
        "not_injectable": schedule.NOT_INJECTABLE, "scheduled": len(events)}
    try:
        rc = _soak(world, args, seed, events, result, out)
    finally:
        world.teardown()
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return rc


def _soak(world: World, args: argparse.Namespace, seed: int, events: list[schedule.Event], result: dict[str, Any],
          out: Path) -> int:
    elog = open(out.with_suffix(".events.jsonl"), "w", encoding="utf-8")  # noqa: SIM115 - closed below

    def record(entry: dict[str, Any]) -> None:
        elog.write(json.dumps({"t": round(world.now(), 2)} | entry) + "\n")
        elog.flush()

    for ev in events:
        record({"schedule": ev.to_json()})
    world.setup()
    chk = world.checker
    spec = trainer_spec(args.steps, args.interval)
    rng = random.Random(f"{seed}:jobs")
    stop = threading.Event()
    reference: dict[int, float] | None = None

    def check_loop() -> None:
        while not stop.is_set():
            try:
                world.observe()
            except Exception as exc:  # noqa: BLE001 (an API fault of the admin's own request: the next round)
                _log(f"observation round failed: {exc!r}"[:300])
            stop.wait(CHECK_INTERVAL)

    checker = threading.Thread(target=check_loop, name="chaos-checker", daemon=True)
    checker.start()
    try:
        if args.reference:
            reference, _ = _losses(Path(args.reference))
        else:
            _log("reference job (no faults)")
            world.submit("ref", "reference", spec)
            _wait_ended(world, ["ref"])
            reference, _ = _losses(world.volume / "ref" / "metrics.jsonl")
            if len(reference) != args.steps:
                chk.violate(world.now(), "ref", "reference incomplete", f"{len(reference)} of {args.steps} steps")
        out.with_suffix(".reference.jsonl").write_text(
            "".join(json.dumps({"step": k, "loss": v}) + "\n" for k, v in sorted(reference.items())))
        start = world.now()
        counter = 0
        load_until: dict[str, float] = {}
        pending = list(events)
        waiting: list[schedule.Event] = []  # rank and checkpoint events that found no candidate yet
        _log(f"{len(events)} faults over {args.minutes:g} minutes, {args.jobs} trainer jobs and {args.load_jobs} "
             "load jobs at once")
        while world.now() - start < args.minutes * 60:
            now = world.now()
            # Keep the job counts up; load jobs live a while, then are deleted (their pods must go).
            live = [n for n, t in chk.tracks() if t.kind == "trainer" and t.phase not in TERMINAL]
            for _ in range(args.jobs - len(live)):
                counter += 1
                world.submit(f"t{counter:04d}", "trainer", spec)
            for name, until in list(load_until.items()):
                if now >= until:
                    world.delete_job(name, "load")
                    del load_until[name]
            while len(load_until) < args.load_jobs:
                counter += 1
                name = f"l{counter:04d}"
                world.submit(name, "load", load_spec())
                load_until[name] = now + rng.uniform(60, 240)
            for what, fn in world.injector.due():
                try:
                    fn()
                    record({"undo": what})
                except Exception as exc:  # noqa: BLE001
                    record({"undo": what, "error": repr(exc)[:300]})
            due, waiting = waiting, []
            while pending and pending[0].at <= now - start:
                due.append(pending.pop(0))
            for ev in due:
                entry: dict[str, Any] = {"kind": ev.kind, "at": ev.at, "pick": ev.pick}
                try:
                    hit = world.injector.fire(ev)
                    entry |= {"injected": True, "jobs": hit.jobs, "target": hit.target, **hit.detail}
                    for job in hit.jobs:
                        chk.fault(job, ev.kind, world.now())
                    if not hit.jobs:
                        chk.fault(None, ev.kind, world.now())
                    _log(f"{ev.kind}: {hit.target} {hit.jobs or ''}")
                except Skip as why:
                    # A rank or a checkpoint is there only while a gang trains: such an event waits a while for one
                    # (a gang between attempts) before it counts as skipped.
                    if ev.target in ("rank", "checkpoint") and world.now() - start - ev.at < DEFER_S:
                        waiting.append(ev)
                        continue
                    entry |= {"injected": False, "skipped": str(why)}
                except Exception as exc:  # noqa: BLE001 (an injection that failed is logged, not the end)
                    entry |= {"injected": False, "error": repr(exc)[:300]}
                    _log(f"{ev.kind} failed: {exc!r}"[:300])
                record(entry)
            time.sleep(0.5)
        for ev in waiting:
            record({"kind": ev.kind, "at": ev.at, "pick": ev.pick, "injected": False,
                    "skipped": "no candidate before the faults were over"})
        _log("faults over: healing, deleting the load jobs, then waiting for every trainer job to end")
        for what in world.injector.heal():
            record({"undo": what, "at_end": True})
        # The load jobs load the operator while the faults run; kept while the trainers finish, they would sit
        # Running without progress past their own deadlines and be counted stuck (seed 41's soak in CI).
        for name in list(load_until):
            world.delete_job(name, "load")
        trainers = [n for n, t in chk.jobs.items() if t.kind == "trainer"]
        _wait_ended(world, trainers)
        for name in trainers + (["ref"] if "ref" in chk.jobs else []):
            world.delete_job(name, "trainer")
        _wait_pods_gone(world)
    finally:
        stop.set()
        checker.join(60)
        elog.close()
    with contextlib.suppress(Exception):
        world.observe()  # one last round: the orphans
    losses = {n: _losses(world.volume / n / "metrics.jsonl") for n, t in chk.jobs.items() if t.kind == "trainer"}
    limits = {n: (int(t.spec["faultTolerance"]["maxRestarts"]), int(t.spec["faultTolerance"]["maxInfraRestarts"]))
              for n, t in chk.jobs.items() if t.kind != "load"}
    chk.finish(world.now(), reference, losses, limits)
    _figure(world, result, limits, out)
    return 0 if not chk.violations else 1


def _wait_ended(world: World, names: list[str]) -> None:
    """Until every named job is Succeeded or Failed, or one is reported stuck (its own deadline passed)."""
    chk = world.checker
    while True:
        tracks = [chk.jobs[n] for n in names]
        if all(t.phase in TERMINAL or t.stuck_reported for t in tracks):
            return
        time.sleep(CHECK_INTERVAL)


def _wait_pods_gone(world: World) -> None:
    """Until the deleted jobs' pods are gone, at most the orphan deadline (then the checker has reported them)."""
    d = world.checker.deadlines
    deadline = time.monotonic() + d.termination_grace + d.node_lost_grace + 4 * d.check_interval
    while time.monotonic() < deadline:
        if not world.snapshot["pods"]:
            return
        time.sleep(CHECK_INTERVAL)


def _figure(world: World, result: dict[str, Any], limits: dict[str, tuple[int, int]], out: Path) -> None:
    chk = world.checker
    entries = [json.loads(x) for x in out.with_suffix(".events.jsonl").read_text().splitlines()]
    injected = [e for e in entries if e.get("injected")]
    trainers = {n: t for n, t in chk.jobs.items() if t.kind == "trainer"}
    failed = {n for n, t in trainers.items() if t.phase == "Failed"}
    expected = {n for n in failed if chk.expected_failure(n, limits[n])}
    def survived(e: dict[str, Any]) -> bool:
        """A fault that hit jobs: each of them Succeeded (or was a load job). One that hit no job (the API, the
        operator): no violation within the longest deadline after it."""
        if e.get("jobs"):
            return all(chk.jobs[j].phase == "Succeeded" or chk.jobs[j].kind == "load" for j in e["jobs"]
                       if j in chk.jobs)
        window = max((stuck_after(t.spec, 0, chk.deadlines) for t in trainers.values()), default=0.0)
        return not any(e["t"] <= v.at <= e["t"] + window for v in chk.violations)

    productive = sum(float(t.status.get("productiveSeconds") or 0) for t in trainers.values())
    lost = sum(sum((t.status.get("lostSeconds") or {}).values()) for t in trainers.values())
    limit = chart_memory_limit()
    if limit is not None and world.peak_rss > limit:
        chk.violate(world.now(), "-", "operator memory", f"peak RSS {world.peak_rss >> 20} MiB over the chart's "
                     f"limit {limit >> 20} MiB")
    result.update({
        "jobs_run": len(trainers), "load_jobs_run": sum(t.kind == "load" for t in chk.jobs.values()),
        "faults_injected": len(injected), "faults_by_kind": dict(Counter(e["kind"] for e in injected).most_common()),
        "faults_skipped": dict(Counter(e["kind"] for e in entries if e.get("injected") is False).most_common()),
        "faults_survived": sum(survived(e) for e in injected),
        "jobs_succeeded": sum(t.phase == "Succeeded" for t in trainers.values()),
        "jobs_failed": {"expected": len(expected), "unexpected": len(failed - expected)},
        "stuck": chk.stuck, "duplicate_pods": chk.duplicate_pods, "orphan_pods": chk.orphans,
        "checkpoints_lost": chk.checkpoints_lost,
        "steps_recomputed": sum(sum(t.status.get("stepsLost") or []) for t in trainers.values()),
        "restarts": sum(t.restarts for t in trainers.values()),
        "infra_restarts": sum(t.infra_restarts for t in trainers.values()),
        "goodput": round(productive / (productive + lost), 4) if productive + lost else None,
        "operator": {"peak_rss_mib": round(world.peak_rss / 2**20, 1),
                     "chart_limit_mib": round(limit / 2**20, 1) if limit else None,
                     "starts": len(world.op_pids)},
        "violations": [v.to_json() for v in chk.violations],
        "events_log": str(out.with_suffix(".events.jsonl")), "operator_log": str(world.op.log)})
