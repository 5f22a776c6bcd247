"""`seqtrain operator [options]`: run the operator against the kubeconfig or the in-cluster service account.

Leader election is kopf peering: operators sharing a peering name see each other through a (Cluster)KopfPeering
object and only the one with the highest priority acts; the others stand by. Equal priorities would freeze all of
them, so without --priority each replica draws a random one.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import secrets
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from seqtrain_operator.k8s.pods.manifests import EXTERNAL
from seqtrain_operator.k8s.pods.pushauth import KEY_ENV

if TYPE_CHECKING:
    from seqtrain_operator.k8s.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seqtrain operator", description="Run the SeqTrainJob operator (kopf).")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch only this namespace (repeatable; globs like team-* work)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    p.add_argument("--peering", metavar="NAME", help="leader election through this kopf peering object")
    p.add_argument("--standalone", action="store_true", help="no peering at all (one replica only)")
    p.add_argument("--priority", type=int, help="peering priority (default: random, so replicas never tie)")
    p.add_argument("--peering-lifetime", type=int, default=60, metavar="SECONDS",
                   help="how long a replica's keep-alive counts: a crashed active replica is replaced after "
                        "at most this (kopf's default 60)")
    p.add_argument("--liveness", metavar="URL", help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--progress-port", type=int, default=8471,
                   help="port the trainer serves progress on (0: do not poll progress)")
    p.add_argument("--progress-push-port", type=int, default=0,
                   help="serve the progress push endpoint on this port: rank 0 POSTs its progress here, for clusters "
                        "where the operator cannot reach the pods (0: off)")
    p.add_argument("--progress-push-url", metavar="URL",
                   help="the push endpoint as trainer pods reach it, e.g. http://seqtrain-progress.seqtrain-system"
                        ".svc:8472 (the chart's Service); the key of the jobs' tokens comes from $"
                        f"{KEY_ENV} (none: a random one, and pods of an earlier operator process cannot push)")
    p.add_argument("--trainer-metrics-port", type=int, default=0,
                   help="trainer ranks serve Prometheus /metrics on this port + local rank (0: off)")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port of rank 0")
    p.add_argument("--termination-grace", type=int, default=120,
                   help="seconds a trainer pod has to checkpoint after SIGTERM")
    p.add_argument("--rank-mtbf-hours", type=float, default=None,
                   help="prior mean time between failures of one rank (GPU), hours, for checkpoint.intervalSteps: auto")
    p.add_argument("--kueue-priority-boost-seconds", type=float, default=0.0,
                   help="jobs admitted by Kueue: one point of the Workload's kueue.x-k8s.io/priority-boost per this "
                        "many seconds of work at risk, so Kueue preempts the job that loses the least (needs Kueue's "
                        "PriorityBoost feature gate; 0: off)")
    p.add_argument("--kueue-priority-boost-max", type=int, default=50,
                   help="the largest priority boost (keep it below the gap between your priority classes)")
    p.add_argument("--autoscale", action="store_true",
                   help="the cluster has a node autoscaler: a native gang that does not fit is created unpinned so "
                        "the autoscaler sees its demand (a job's spec.scheduling.autoscale overrides)")
    p.add_argument("--node-lost-grace", type=float, default=40.0,
                   help="seconds a node may be NotReady before its pods count as lost")
    p.add_argument("--termination-overdue", type=float, default=60.0,
                   help="seconds a pod may stay Terminating past its grace period on a Ready node (a wedged kubelet) "
                        "before it is force-deleted")
    p.add_argument("--scheduler-name", action="append", default=[], metavar="GANG=NAME",
                   help=f"schedulerName for an external gang scheduler ({', '.join(EXTERNAL)}), repeatable")
    p.add_argument("--pod-policy", choices=("restricted", "baseline", "privileged"), default="baseline",
                   help="what a job's podTemplate and scheduling may ask of a node (seqtrain.spec.policy), checked "
                        "by the webhook and before any pod is created")
    p.add_argument("--allow-service-account", action="append", default=[], metavar="NAME",
                   help="a ServiceAccount trainer pods may run as (repeatable)")
    p.add_argument("--allow-priority-class", action="append", default=[], metavar="NAME",
                   help="a PriorityClass trainer pods may use (repeatable; none given: any but system-*)")
    p.add_argument("--allow-capability", action="append", default=[], metavar="CAP",
                   help="a capability beyond the policy's own list, e.g. IPC_LOCK for RDMA (repeatable)")
    p.add_argument("--allow-secret", action="append", default=[], metavar="NAME",
                   help="a Secret trainer pods may read (repeatable; '*': any; none given: any at baseline, none at "
                        "restricted)")
    p.add_argument("--network-policy", action="store_true",
                   help="create one NetworkPolicy per job: only the gang's pods reach its pods, only the operator "
                        "the progress port")
    p.add_argument("--operator-namespace", help="with --network-policy: the namespace of the operator's pods")
    p.add_argument("--operator-pod-label", action="append", default=[], metavar="KEY=VALUE",
                   help="with --network-policy: a label of the operator's pods (repeatable)")
    p.add_argument("--api-qps", type=float, default=200.0,
                   help="API requests a second the operator sends on average (0: no limit)")
    p.add_argument("--api-burst", type=int, default=400, help="API requests it may send at once above --api-qps")
    p.add_argument("--workers", type=int, default=64,
                   help="reconcile passes in flight at most, whatever the number of jobs (each holds its job, its "
                        "observation and its plan while it runs)")
    p.add_argument("--creators", type=int, default=16,
                   help="gang creations in flight at most, beside the passes (each POSTs its gang's pods together)")
    p.add_argument("--webhook-port", type=int, default=9443)
    p.add_argument("--webhook-cert-dir", help="serve the validating webhook with tls.crt/tls.key from here")
    p.add_argument("--release-finalizers", action="store_true",
                   help="do not run: remove the operator's finalizer from every SeqTrainJob in scope and exit "
                        "(helm uninstall's post-delete hook: the jobs stay, and stay deletable)")
    p.add_argument("--service-account-dir", metavar="DIR",
                   help="with --release-finalizers: the pod's service-account token and CA are here (default: "
                        "the in-cluster location, else the kubeconfig)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv or []))
    if args.peering_lifetime < 2:
        build_parser().error(f"--peering-lifetime {args.peering_lifetime}: must be at least 2 seconds (keep-alives "
                             "go out every second at best)")
    for flag, value in (("--workers", args.workers), ("--creators", args.creators)):
        if value < 1:
            build_parser().error(f"{flag} {value}: must be at least 1")
    if args.release_finalizers:
        from seqtrain_operator.k8s.api.finalizers import release_finalizers

        return release_finalizers(args.namespace, args.service_account_dir)
    # The trainer's data paths exist inside the pods, not here: do not check them against this filesystem.
    os.environ.setdefault("SEQTRAIN_CHECK_PATHS", "0")
    schedulers = _schedulers(args.scheduler_name)
    from seqtrain_operator.k8s.api.client import cluster_config_problem

    # After the arguments (a usage error is reported as such), before kopf (which would retry forever).
    if (problem := cluster_config_problem()) is not None:
        print(f"seqtrain operator: {problem}", file=sys.stderr)
        return 2
    return _run(args, settings_from(args, schedulers))


def _schedulers(items: list[str]) -> dict[str, str]:
    """--scheduler-name GANG=NAME, repeated, as {gang: schedulerName}."""
    schedulers = {}
    for item in items:
        gang, sep, name = item.partition("=")
        if not sep or gang not in EXTERNAL:
            build_parser().error(f"--scheduler-name {item!r}: expected GANG=NAME with GANG one of {', '.join(EXTERNAL)}")
        schedulers[gang] = name
    return schedulers


def settings_from(args: argparse.Namespace, schedulers: dict[str, str]) -> Settings:
    """The frozen Settings of this operator process (usage errors exit 2 naming the flag)."""
    from seqtrain.spec.policy import PodPolicy
    from seqtrain_operator.k8s.pods import manifests as m
    from seqtrain_operator.k8s.settings import Settings, WebhookConfig

    if args.rank_mtbf_hours is not None and args.rank_mtbf_hours <= 0:
        build_parser().error(f"--rank-mtbf-hours {args.rank_mtbf_hours:g}: must be a positive number of hours")
    if args.kueue_priority_boost_seconds < 0 or args.kueue_priority_boost_max < 0:
        build_parser().error("--kueue-priority-boost-seconds and --kueue-priority-boost-max must be >= 0")
    if args.progress_push_url and not args.progress_push_port:
        build_parser().error("--progress-push-url needs --progress-push-port (the port this operator serves it on)")
    push_key = b""
    if args.progress_push_port:
        push_key = os.environ.get(KEY_ENV, "").strip().encode() or secrets.token_bytes(32)
        if not os.environ.get(KEY_ENV, "").strip():
            print(f"seqtrain operator: no ${KEY_ENV}: progress push tokens use a random key (pods created by "
                  "another operator process cannot push)", file=sys.stderr)
    pods = m.Settings(master_port=args.master_port, progress_port=args.progress_port or None,
                      metrics_port=args.trainer_metrics_port or None,
                      termination_grace_seconds=args.termination_grace, scheduler_names=schedulers,
                      rank_mtbf_hours=args.rank_mtbf_hours, autoscale=args.autoscale,
                      kueue_boost_seconds=args.kueue_priority_boost_seconds,
                      kueue_boost_max=args.kueue_priority_boost_max,
                      pod_policy=PodPolicy.of(args.pod_policy, args.allow_service_account,
                                              args.allow_priority_class, args.allow_capability, args.allow_secret),
                      network_policy=args.network_policy, operator_namespace=args.operator_namespace,
                      operator_labels=dict(item.partition("=")[::2] for item in args.operator_pod_label),
                      progress_push_url=args.progress_push_url if args.progress_push_port else None,
                      push_key=push_key)
    webhook = None
    if args.webhook_cert_dir:
        webhook = WebhookConfig(port=args.webhook_port, certfile=os.path.join(args.webhook_cert_dir, "tls.crt"),
                                keyfile=os.path.join(args.webhook_cert_dir, "tls.key"))
    return Settings(pods=pods, node_lost_grace=args.node_lost_grace, termination_overdue=args.termination_overdue,
                    poll_progress=bool(args.progress_port), push_port=args.progress_push_port or None,
                    metrics_port=args.metrics_port, webhook=webhook, api_qps=args.api_qps,
                    api_burst=args.api_burst, workers=args.workers, creators=args.creators)


def _run(args: argparse.Namespace, settings: Settings) -> int:
    """kopf with one Runtime as its memo, until it stops."""
    import kopf

    from seqtrain_operator.k8s.process import handlers, memprofile
    from seqtrain_operator.k8s.process.runtime import Runtime

    if settings.webhook is not None:
        handlers.enable_webhook()
    traced = memprofile.install()
    kopf.configure(verbose=args.verbose, debug=args.debug)
    logging.getLogger("seqtrain.operator").setLevel(logging.DEBUG if args.debug else logging.INFO)
    standalone = args.standalone or not args.peering
    priority = args.priority if args.priority is not None else random.SystemRandom().randint(1, 2**31 - 1)
    kopf_settings = kopf.OperatorSettings()
    kopf_settings.peering.lifetime = args.peering_lifetime
    kopf.run(
        settings=kopf_settings,
        standalone=standalone,
        peering_name=None if standalone else args.peering,
        priority=priority,
        namespaces=args.namespace or (),
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness,
        memo=handlers.memo_of(Runtime(settings)),
    )
    if traced:
        memprofile.dump(traced)
    return 0
