"""`seqtrain` command line. Thin: parse arguments, call one function, map the result to an exit code.

Exit codes: 0 success, 1 the job failed, 2 invalid input (spec or arguments). Heavy modules (torch, kopf) are
imported only by the subcommand that needs them, so `seqtrain validate` works in the slim operator image.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from seqtrain_operator.client import Client

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2

BENCHMARKS = {
    "kernels": "seqtrain.benchmarks.kernels",
    "memory": "seqtrain.benchmarks.memory",
    "layouts": "seqtrain.benchmarks.layouts",
    "checkpoint": "seqtrain.benchmarks.checkpoint",
    "operator": "seqtrain_operator.benchmark",
    "recovery": "seqtrain_operator.bench_recovery",
    "gpu": "seqtrain.benchmarks.gpu",
    "checkpoint-interval": "seqtrain_operator.interval_bench",
    "overhead": "seqtrain.benchmarks.overhead",
    "step": "seqtrain.benchmarks.step",
    "chaos": "seqtrain_operator.chaos.bench",
}


def _cmd_validate(args: argparse.Namespace) -> int:
    from seqtrain.spec import SpecError, load_jobs
    from seqtrain.spec.memory import memory_notes, memory_problems
    from seqtrain.spec.policy import PodPolicy, job_policy_problems

    policy = PodPolicy.of(args.policy, args.allow_service_account or (), args.allow_priority_class or (),
                          args.allow_capability or (), args.allow_secret or ())
    bad = 0
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            jobs = load_jobs(text, args.set or ())
            # the same memory verdict as `plan` and `run` (one estimate, the rank process's baseline included)
            problems = [p for j in jobs for p in job_policy_problems(j.spec, policy, j.name)] + \
                [p for j in jobs for p in memory_problems(j)]
            if problems:
                raise SpecError(problems)
        except OSError as exc:
            print(f"{path}: <file>: cannot read: {exc.strerror}", file=sys.stderr)
            bad += 1
            continue
        except UnicodeDecodeError:
            print(f"{path}: <file>: not UTF-8 text", file=sys.stderr)
            bad += 1
            continue
        except SpecError as err:
            for p in err.problems:
                print(f"{path}: {p}", file=sys.stderr)
            bad += 1
            continue
        if not args.quiet:
            names = ", ".join(j.name for j in jobs)
            print(f"{path}: valid ({names})")
            from seqtrain.spec.resolve import job_notes

            for j in jobs:  # derived model fields with their origin; warnings that are not errors
                print("\n".join(f"{path}: note: {n}" for n in [*job_notes(j), *memory_notes(j)]))
    return EXIT_INVALID if bad else EXIT_OK


def _cmd_crd(args: argparse.Namespace) -> int:
    from seqtrain.spec.crd import crd_yaml

    if args.check:
        return _check_crd()
    sys.stdout.write(crd_yaml())
    return EXIT_OK


def _check_crd() -> int:
    """Compare the cluster's CRD (KUBECONFIG or in-cluster) with this version's: exit 1 naming what it lacks."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from seqtrain.spec import API_GROUP, PLURAL
    from seqtrain.spec.crd import UPGRADE_HINT, drift_message, missing_fields
    from seqtrain_operator.k8s.api.client import load_config

    name = f"{PLURAL}.{API_GROUP}"
    try:
        installed = client.ApiextensionsV1Api(load_config()).read_custom_resource_definition(
            name, _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            print(f"seqtrain crd --check: {name} is not installed; {UPGRADE_HINT}", file=sys.stderr)
            return 1
        print(f"seqtrain crd --check: could not read {name}: {exc.status} {exc.reason}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - no cluster configured or reachable
        print(f"seqtrain crd --check: could not reach the cluster: {exc}", file=sys.stderr)
        return 1
    missing = missing_fields(json.loads(installed.data))
    if missing:
        print(f"seqtrain crd --check: {drift_message(missing)}", file=sys.stderr)
        return 1
    print(f"{name}: up to date with this seqtrain")
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from seqtrain_operator.local.runner import run_file

    return run_file(args.file, workdir=args.workdir, overrides=args.set or [], quiet=args.quiet)


def _cmd_train(args: argparse.Namespace) -> int:
    # Several ranks in this pod: our launcher keeps their exit codes (torchrun does not). One rank goes through it
    # too when it may restart in place (seqtrain.runtime.restart): the launcher outlives the rank.
    if args.nproc_per_node > 1 or os.environ.get("SEQTRAIN_INPLACE_DELAYS", "").strip():
        from seqtrain.runtime.launch import main as launch_main

        return launch_main(args.config, args.nproc_per_node)
    from seqtrain.train.entry import leave
    from seqtrain.train.entry import main as train_main

    leave(train_main(args.config))  # the rank process ends here (why: `leave`)


def _number(text: str, kind: type[int] | type[float], what: str) -> float:
    """argparse's `type=` for a number: a one-line usage error naming the text, never a traceback."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not math.isfinite(value):  # float() takes 'nan' and 'inf'; no option of ours means either
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _positive_int(text: str) -> int:
    value = int(_number(text, int, "an integer"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _cmd_plan(args: argparse.Namespace) -> int:
    from seqtrain_operator.planner.show import plan_command

    return plan_command(args.file, nodes_file=args.nodes, overrides=args.set or [], as_json=args.json)


def _cmd_operator(args: argparse.Namespace, rest: list[str]) -> int:
    from seqtrain_operator.k8s.main import main as operator_main

    return operator_main(rest)


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.name is None:
        args.bench_parser.print_help(sys.stdout if args.help else sys.stderr)
        return 0 if args.help else 2
    if args.help:  # `seqtrain bench NAME --help` shows the benchmark's own options
        rest = ["--help", *rest]
    module = importlib.import_module(BENCHMARKS[args.name])
    return int(module.main(rest) or 0)


def _cmd_report(args: argparse.Namespace) -> int:
    from seqtrain.obs.report import report_command

    if args.out and (os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(os.path.abspath(args.out)))):
        print(f"seqtrain report: --out {args.out}: name a PNG file in an existing folder", file=sys.stderr)
        return EXIT_INVALID
    return report_command(args.workdir, out=args.out)


def _cmd_export(args: argparse.Namespace) -> int:
    from seqtrain.export.writer import export_command

    return export_command(args.source, args.out, args.format, args.merge_lora)


def _nonnegative_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must not be negative")
    return value


def _probability(text: str) -> float:
    value = _nonnegative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return value


def _cmd_generate(args: argparse.Namespace) -> int:
    from seqtrain.generate import Sampling, generate_command

    s = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, seed=args.seed)
    return generate_command(args.source, args.prompt, s, use_cache=not args.no_cache, device=args.device,
                            prompt_ids=args.prompt_ids)


def _prompt_ids(text: str) -> list[int]:
    """--prompt-ids 1,2,3: comma-separated non-negative integers (a one-line usage error otherwise)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):  # no sign, no empty entry, no 1e3
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated non-negative integers such as 1,2,3")
    return [int(p) for p in parts]


def _cmd_prepare_data(args: argparse.Namespace) -> int:
    from seqtrain.data.prepare import prepare_command

    return prepare_command(args.inputs, args.out, args.tokenizer, args.workers, args.field, quiet=args.quiet,
                           overwrite=args.overwrite, fmt=args.format)


# ---- cluster commands (seqtrain_operator.client; --local: the same against run folders) --------------------------

_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration(text: str) -> float:
    """Seconds, or kubectl's 30s / 10m / 2h / 1d."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * _DURATION_UNITS[t[-1]] if t and t[-1] in _DURATION_UNITS else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (seconds, or like 30s, 10m, 2h)") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive duration")
    return value


def _client(args: argparse.Namespace) -> Client:
    from seqtrain_operator.client import Client

    if args.local:
        return Client(local=True, runs_dir=args.runs_dir)
    return Client(context=args.context, namespace=args.namespace)


def _cluster(args: argparse.Namespace) -> int:
    """Run one cluster command; a ClientError is one line on stderr and its exit code (never a traceback)."""
    from seqtrain_operator.client import ClientError, InvalidJob

    try:
        return int(args.cluster_func(args))
    except InvalidJob as err:
        for p in err.problems:
            print(f"{err.source}: {p}", file=sys.stderr)
        return err.exit_code
    except ClientError as err:
        print(f"seqtrain {args.command}: {err}", file=sys.stderr)
        return err.exit_code


def _cmd_submit(args: argparse.Namespace) -> int:
    from seqtrain.spec import parse_job
    from seqtrain.spec.memory import memory_problems
    from seqtrain_operator.client import InvalidJob, prepare

    doc = prepare(args.file, args.set or (), args.name, args.namespace)  # invalid: exit 2 before any cluster call
    # the memory verdict `validate`, `plan` and `run` give (microBatchSize auto: the size the estimate chooses), so a
    # job that cannot fit is refused here with run's line and exit code, not OOM-killed on the cluster
    if problems := memory_problems(parse_job(doc)):
        raise InvalidJob(args.file, [str(p) for p in problems])
    c = _client(args)
    job = c.submit(args.file, set=args.set or (), name=args.name, namespace=args.namespace)
    where = f"in namespace {job.namespace}" if job.namespace else f"locally (run folder {job.workdir})"
    print(f"seqtrainjob {job.name} submitted {where}")
    if not args.wait:
        return EXIT_OK
    return _report_wait(c, job.name, ("Succeeded",), args.timeout)


def _report_wait(c: Client, name: str, phases: tuple[str, ...], timeout: float | None) -> int:
    from seqtrain_operator.client import JobEnded
    from seqtrain_operator.client.display import step_text

    try:
        job = c.wait(name, phases, timeout)
    except JobEnded as ended:
        print(f"{name}: {ended.job.phase} at step {step_text(ended.job)}"
              + (f": {ended.job.status.message}" if ended.job.status.message else ""), file=sys.stderr)
        return EXIT_FAILED
    print(f"{name}: {job.phase} at step {step_text(job)}" + (f": {job.status.message}" if job.status.message else ""))
    return EXIT_OK


def _cmd_list(args: argparse.Namespace) -> int:
    from seqtrain_operator.client.display import list_table

    c = _client(args)
    jobs = c.list(all_namespaces=args.all_namespaces)
    if not jobs:
        where = ("in any namespace" if args.all_namespaces else f"in namespace {c.namespace}") if c.namespace \
            else f"under {args.runs_dir}/"
        print(f"No SeqTrainJobs {where}.", file=sys.stderr)
        return EXIT_OK
    sys.stdout.write(list_table(jobs, namespaces=args.all_namespaces and not args.local))
    return EXIT_OK


def _cmd_status(args: argparse.Namespace) -> int:
    from seqtrain_operator.client.display import status_text

    c = _client(args)
    job = c.get(args.job)
    sys.stdout.write(status_text(job, c.events(args.job)))
    return EXIT_OK


def _cmd_logs(args: argparse.Namespace) -> int:
    c = _client(args)
    attempt = args.attempt
    if args.previous:
        current = c.get(args.job).status.attempt
        if current < 2:
            print(f"seqtrain logs: {args.job} has no previous attempt (attempt {current or 'none yet'})",
                  file=sys.stderr)
            return EXIT_FAILED
        attempt = current - 1
    shown = 0
    for line in c.logs(args.job, follow=args.follow, rank=args.rank, all_ranks=args.all, attempt=attempt):
        print(line, flush=True)
        shown += 1
    if not shown:
        job = c.get(args.job)
        print(f"seqtrain logs: no logs of {args.job} to show (phase {job.phase}"
              + (f", attempt {attempt}" if attempt else "") + "); -f waits for them", file=sys.stderr)
    return EXIT_OK


def _cmd_wait(args: argparse.Namespace) -> int:
    from seqtrain_operator.client.api import phases_of

    return _report_wait(_client(args), args.job, phases_of(args.phase or ["Succeeded"]), args.timeout)


def _cmd_delete(args: argparse.Namespace) -> int:
    c = _client(args)
    c.delete(args.job, wait=args.wait, timeout=args.timeout)
    print(f"seqtrainjob {args.job} deleted" + (" (and its pods are gone)" if args.wait else ""))
    return EXIT_OK


def _cmd_suspend(args: argparse.Namespace) -> int:
    c = _client(args)
    job = c.suspend(args.job) if args.command == "suspend" else c.resume(args.job)
    print(f"seqtrainjob {job.name} {'suspended' if args.command == 'suspend' else 'resumed'} (phase {job.phase})")
    return EXIT_OK


class _Version(argparse.Action):
    """--version, looked up only when asked: importlib.metadata's scan costs every command about 0.05 s, and
    `seqtrain run` pays it twice before its ranks start (the runner, then each replica's `seqtrain train`)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help=help or "show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"seqtrain {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("seqtrain")
    except PackageNotFoundError:  # run from a source tree that is not installed
        import seqtrain

        return seqtrain.__version__


def _add_cluster_commands(sub: argparse._SubParsersAction, job_file: argparse.ArgumentParser) -> None:
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--context", help="kubeconfig context (default: the current one)")
    where.add_argument("-n", "--namespace", help="namespace (default: the context's, else default)")
    where.add_argument("--local", action="store_true",
                       help="jobs on this machine instead (seqtrain run in the background, run folders under "
                            "--runs-dir)")
    where.add_argument("--runs-dir", default="runs", help="with --local: where run folders live (default runs)")

    def cmd(name: str, func: Any, help_text: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, parents=[*parents, where])
        p.set_defaults(func=_cluster, cluster_func=func)
        return p

    s = cmd("submit", _cmd_submit, "validate a job file locally, then create it on the cluster", job_file)
    s.add_argument("--name", help="submit under this metadata.name")
    s.add_argument("--wait", action="store_true", help="then wait until it ends: exit 0 Succeeded, 1 Failed")
    s.add_argument("--timeout", type=_duration, metavar="DURATION", help="with --wait: give up after this (exit 124)")

    ls = cmd("list", _cmd_list, "the jobs: name, phase, step/total, loss, tok/s, restarts, ETA, age")
    ls.add_argument("-A", "--all-namespaces", action="store_true", help="the jobs of every namespace")

    st = cmd("status", _cmd_status, "a job's progress, conditions, restarts, lost time, checkpoint and last events")
    st.add_argument("job", metavar="JOB")

    lg = cmd("logs", _cmd_logs, "a job's trainer logs, each line prefixed with its rank; -f follows restarts")
    lg.add_argument("job", metavar="JOB")
    lg.add_argument("-f", "--follow", action="store_true",
                    help="follow across restarts and re-created pods until the job ends")
    which = lg.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="N", help="the pod that runs rank N (default 0)")
    which.add_argument("--all", action="store_true", help="every rank, interleaved")
    when = lg.add_mutually_exclusive_group()
    when.add_argument("--attempt", type=_positive_int, metavar="K", help="only gang attempt K (1: the first)")
    when.add_argument("--previous", action="store_true", help="only the attempt before the current one")

    w = cmd("wait", _cmd_wait, "wait for a phase: exit 0 reached, 1 the job ended otherwise, 124 timed out")
    w.add_argument("job", metavar="JOB")
    w.add_argument("--for", dest="phase", action="append", metavar="PHASE",
                   help="Succeeded (default), Failed, Running, Suspended, ... (repeatable: any of them)")
    w.add_argument("--timeout", type=_duration, metavar="DURATION", help="give up after this (exit 124)")

    d = cmd("delete", _cmd_delete, "delete a job (its pods, Service and ConfigMaps go with it)")
    d.add_argument("job", metavar="JOB")
    d.add_argument("--wait", action="store_true", help="until the job and its pods are gone")
    d.add_argument("--timeout", type=_duration, default=300.0, metavar="DURATION",
                   help="with --wait: give up after this (default 300s; exit 124)")

    for verb, text in (("suspend", "stop a job's gang (spec.suspend: true; ranks save a checkpoint first)"),
                       ("resume", "start a suspended job again from its latest checkpoint (spec.suspend: false)")):
        cmd(verb, _cmd_suspend, text).add_argument("job", metavar="JOB")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seqtrain", description="Distributed training of sequence models.")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    set_help = "override a spec field by dotted path, e.g. training.steps=20 (repeatable)"
    job_file = argparse.ArgumentParser(add_help=False)  # what run, plan and submit read: one job file and --set
    job_file.add_argument("file", metavar="FILE")
    job_file.add_argument("--set", action="append", metavar="PATH=VALUE", help=set_help)

    v = sub.add_parser("validate", help="check SeqTrainJob files; exit 2 with one line per problem")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.add_argument("--set", action="append", metavar="PATH=VALUE", help=set_help)
    v.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    v.add_argument("--policy", choices=("restricted", "baseline", "privileged"), default="baseline",
                   help="the pod policy the cluster's operator enforces (chart value podPolicy.level; default "
                        "baseline): what spec.podTemplate and spec.scheduling may ask of a node")
    v.add_argument("--allow-service-account", action="append", metavar="NAME",
                   help="a ServiceAccount the cluster's pod policy allowlists (repeatable)")
    v.add_argument("--allow-priority-class", action="append", metavar="NAME",
                   help="a PriorityClass the cluster's pod policy allowlists (repeatable)")
    v.add_argument("--allow-capability", action="append", metavar="CAP",
                   help="a capability the cluster's pod policy allowlists, e.g. IPC_LOCK (repeatable)")
    v.add_argument("--allow-secret", action="append", metavar="NAME",
                   help="a Secret the cluster's pod policy allowlists (repeatable; '*': any)")
    v.set_defaults(func=_cmd_validate)

    c = sub.add_parser("crd", help="print the CustomResourceDefinition generated from the spec models")
    c.add_argument("--check", action="store_true", help="instead, compare the cluster's CRD with this version's "
                   "and exit 1 naming the fields it lacks (an older CRD prunes them from every job)")
    c.set_defaults(func=_cmd_crd)

    r = sub.add_parser("run", help="run a job on this machine (local backend)", parents=[job_file])
    r.add_argument("--workdir", help="run folder (default ./runs/<metadata.name>); reused to resume")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar, only the final line")
    r.set_defaults(func=_cmd_run)

    t = sub.add_parser("train", help="per-rank trainer entrypoint (pods and local processes run this)")
    t.add_argument("--config", required=True, help="resolved trainer config (JSON)")
    t.add_argument("--nproc-per-node", type=_positive_int, default=1, metavar="N",
                   help="start N rank processes here (RANK = NODE_RANK*N + local rank) and exit with their most "
                        "specific exit code (default 1: this process is the rank)")
    t.set_defaults(func=_cmd_train)

    pl = sub.add_parser("plan", help="print the resolved plan: layout, placement, memory per rank", parents=[job_file])
    pl.add_argument("--nodes", help="node inventory YAML (default: this machine as one node)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.set_defaults(func=_cmd_plan)

    o = sub.add_parser("operator", help="run the Kubernetes operator (extra options go to kopf)", add_help=False)
    o.set_defaults(func=_cmd_operator, passthrough=True)

    b = sub.add_parser("bench", help="run a benchmark and write JSON (extra options go to the benchmark)",
                       add_help=False)
    b.add_argument("name", nargs="?", choices=sorted(BENCHMARKS), help="benchmark; NAME --help lists its options")
    b.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    b.set_defaults(func=_cmd_bench, passthrough=True, bench_parser=b)

    rp = sub.add_parser("report", help="write a one-page summary of a run folder and print its table")
    rp.add_argument("workdir", metavar="WORKDIR")
    rp.add_argument("--out", help="output PNG (default WORKDIR/report.png)")
    rp.set_defaults(func=_cmd_report)

    ex = sub.add_parser("export", help="write a run's or checkpoint's model as a Hugging Face (or seqtrain) folder")
    ex.add_argument("source", metavar="CHECKPOINT_OR_RUN_DIR",
                    help="run folder, checkpoints/step-N folder (any engine or layout) or model folder")
    ex.add_argument("--format", choices=["hf", "seqtrain"], default="hf",
                    help="hf: Llama folder for transformers (GPT); seqtrain: own safetensors (default for RNNs)")
    ex.add_argument("--out", required=True, help="output folder")
    ex.add_argument("--merge-lora", action="store_true", help="merge LoRA adapters into the base weights")
    ex.set_defaults(func=_cmd_export)

    g = sub.add_parser("generate", help="sample text from a trained model, streaming to the terminal")
    g.add_argument("source", metavar="RUN_OR_DIR", help="run folder, checkpoint folder or exported model folder")
    which = g.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="text the sample continues")
    which.add_argument("--prompt-ids", type=_prompt_ids, metavar="1,2,3",
                       help="token ids the sample continues (the sample is printed as ids): for a model trained on "
                            "ids without a tokenizer (data.source tokens)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=200, metavar="N")
    g.add_argument("--temperature", type=_nonnegative_float, default=0.8, metavar="T", help="0: greedy")
    g.add_argument("--top-k", type=_positive_int, default=None, metavar="K")
    g.add_argument("--top-p", type=_probability, default=None, metavar="P")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="seed of the sampler (reproducible samples)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence per token (no KV cache / recurrent state): for checks")
    g.set_defaults(func=_cmd_generate)

    pd = sub.add_parser("prepare-data", help="tokenize text/jsonl/parquet/saved datasets into token shards")
    pd.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="files, globs or folders (.jsonl, .parquet, anything else is text) or a saved datasets folder")
    pd.add_argument("--out", required=True, help="output folder (rerun with the same inputs to resume)")
    pd.add_argument("--tokenizer", default="byte",
                    help="byte (default), a tokenizer.json, a Hugging Face model folder holding one (as model.init "
                         "takes it), or hf://ORG/NAME[@REVISION] from the local Hugging Face cache")
    pd.add_argument("--workers", type=_positive_int, default=1, metavar="N", help="parallel worker processes")
    pd.add_argument("--field", default="text",
                    help="text field of jsonl records, parquet and dataset columns (with --format chat: the "
                         "messages list, default messages)")
    pd.add_argument("--format", default="text", choices=("text", "chat"),
                    help="chat: jsonl lines of {role, content} messages through the tokenizer folder's chat "
                         "template; only the assistant turns are scored (data.format chat, prepared)")
    pd.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pd.add_argument("--overwrite", action="store_true",
                    help="replace what an earlier prepare-data wrote into --out (other inputs or settings)")
    pd.set_defaults(func=_cmd_prepare_data)

    _add_cluster_commands(sub, job_file)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    passthrough = getattr(args, "passthrough", False)  # operator and bench pass on the arguments they do not define
    if rest and not passthrough:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.func(args, rest) if passthrough else args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`seqtrain crd | head`): exit as a shell tool killed by SIGPIPE does, without a
        # traceback. stdout goes to /dev/null first, or the interpreter's flush at exit fails on the pipe again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
