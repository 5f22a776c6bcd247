"""The client's Kubernetes backend: SeqTrainJob custom resources and their pods, through the current kube context.

Synchronous (the official client): a command makes a handful of calls. Every call has a timeout, and a cluster
that does not answer, a missing kubeconfig or context, and a missing CRD are each one `ClientError` line that says
what to do.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from seqtrain.spec import API_GROUP, API_VERSION, KIND, PLURAL
from seqtrain_operator.client.follow import ContainerState, Follower, Open, PodView, Selection
from seqtrain_operator.client.model import (
    ClientError,
    Event,
    InvalidJob,
    Job,
    NoCluster,
    NotFound,
    job_from_object,
)
from seqtrain_operator.k8s.api.client import api_message
from seqtrain_operator.k8s.owner import LABEL_UID
from seqtrain_operator.k8s.pods.manifests import CONTAINER, LABEL_ATTEMPT, LABEL_JOB, LABEL_REPLICA

_VERSION = API_VERSION.split("/")[1]
TIMEOUT = (5.0, 30.0)  # (connect, read) seconds of every call but a followed log
# A followed log may be silent for long (a slow step, a checkpoint): a read that times out only ends the stream,
# and the follower reopens it past the lines already shown while the container runs.
FOLLOW_TIMEOUT = (5.0, 300.0)
INSTALL_HINT = ("install the operator and its CRD first: helm install seqtrain oci://ghcr.io/seqtrain/charts/seqtrain "
                "-n seqtrain-system --create-namespace")
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def kubeconfig_path() -> str:
    raw = os.environ.get("KUBECONFIG", "")
    return next((p for p in raw.split(os.pathsep) if p), os.path.expanduser("~/.kube/config"))


def connect(context: str | None = None) -> tuple[client.ApiClient, str]:
    """(API client, the context's namespace) for `context` (None: the current one), or the in-cluster service
    account when there is no kubeconfig and no context was asked for. Raises NoCluster with the fix."""
    path = kubeconfig_path()
    cfg = client.Configuration()
    if context is None and not os.path.exists(path) and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config(client_configuration=cfg)
            with open(SA_NAMESPACE, encoding="utf-8") as f:
                return _api(cfg), f.read().strip() or "default"
        except (config.ConfigException, OSError):
            pass
    if not os.path.exists(path):
        raise NoCluster(f"no kubeconfig at {path}: point KUBECONFIG at your cluster's kubeconfig (e.g. `kind create "
                        "cluster` writes ~/.kube/config) or run this inside the cluster")
    try:
        contexts, current = config.list_kube_config_contexts(config_file=path)
    except Exception as exc:  # noqa: BLE001 - any unreadable kubeconfig is the same problem for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NoCluster(f"{path} is not a usable kubeconfig ({first}): fix it or point KUBECONFIG elsewhere") from None
    names = [c["name"] for c in contexts or []]
    if context is not None and context not in names:
        raise NoCluster(f"--context {context}: not in {path} (it has: {', '.join(names) or 'none'})")
    if context is None and not current:
        raise NoCluster(f"{path} has no current context: pass --context NAME (one of: {', '.join(names) or 'none'}) "
                        "or run `kubectl config use-context NAME`")
    chosen = next(c for c in contexts if c["name"] == (context or current["name"]))
    namespace = (chosen.get("context") or {}).get("namespace") or "default"
    try:
        config.load_kube_config(config_file=path, context=context, client_configuration=cfg, persist_config=False)
    except Exception as exc:  # noqa: BLE001
        raise NoCluster(f"context {chosen['name']} in {path} is not usable: {exc}") from None
    return _api(cfg), namespace


def _api(cfg: client.Configuration) -> client.ApiClient:
    # Read when the client builds its connection pool, so set before: one retry (an unreachable cluster is reported
    # in seconds, not after urllib3's three tries with backoff), and room for `logs --all`'s one stream per pod.
    cfg.retries = 1
    cfg.connection_pool_maxsize = 64
    return client.ApiClient(cfg)


def _reason(exc: BaseException) -> str:
    text = str(getattr(exc, "reason", None) or exc)
    return text.rsplit(": ", 1)[-1].strip(" )'\"") if "Errno" in text or "Connection" in text else text


class KubeJobs:
    """The Kubernetes side of `seqtrain.client.Client`."""

    def __init__(self, context: str | None = None, namespace: str | None = None, poll_seconds: float = 1.0):
        api, default_ns = connect(context)
        self.api = api
        self.namespace = namespace or default_ns
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.poll = poll_seconds

    # ---- calls with one error mapping ------------------------------------------------------------------------

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, _request_timeout=TIMEOUT, **kw)
        except ApiException as exc:
            raise self._error(what, exc) from None
        except (Urllib3Error, OSError) as exc:
            raise self._unreachable(exc) from None

    def _error(self, what: str, exc: ApiException) -> ClientError:
        if not exc.status:
            return self._unreachable(exc)
        if exc.status == 404 and "could not find the requested resource" in (exc.body or ""):
            return ClientError(f"{what}: this cluster has no {KIND} resource type: {INSTALL_HINT}")
        if exc.status == 404:
            return NotFound(f"{what}: not found in namespace {self.namespace}")
        if exc.status in (401, 403):
            return ClientError(f"{what}: {api_message(exc)} (check the context's credentials and RBAC, or pick "
                               "another namespace with -n)")
        return ClientError(f"{what}: {api_message(exc)}")

    def _unreachable(self, exc: BaseException) -> NoCluster:
        host = self.api.configuration.host
        return NoCluster(f"cannot reach the cluster at {host} ({_reason(exc)}): check that it runs (`kubectl "
                         "cluster-info`) or pick another context with --context")

    # ---- jobs -------------------------------------------------------------------------------------------------

    def create(self, body: dict[str, Any]) -> Job:
        name = body["metadata"]["name"]
        ns = body["metadata"].get("namespace") or self.namespace
        body["metadata"]["namespace"] = ns
        try:
            obj = self.custom.create_namespaced_custom_object(API_GROUP, _VERSION, ns, PLURAL, body,
                                                              _request_timeout=TIMEOUT)
        except ApiException as exc:
            if exc.status == 409:
                raise ClientError(f"{KIND} {name} already exists in namespace {ns}: `seqtrain delete {name} --wait` "
                                  "first, or submit it under another name (--name)") from None
            if exc.status in (400, 422) or (exc.status == 403 and "admission webhook" in (exc.body or "")):
                raise InvalidJob(name, [f"rejected by the cluster: {api_message(exc)}"]) from None
            raise self._error(f"{KIND} {name}", exc) from None
        except (Urllib3Error, OSError) as exc:
            raise self._unreachable(exc) from None
        return job_from_object(obj)

    def get_object(self, name: str) -> dict[str, Any]:
        return self._call(f"{KIND} {name}", self.custom.get_namespaced_custom_object, API_GROUP, _VERSION,
                          self.namespace, PLURAL, name)

    def get(self, name: str) -> Job:
        return job_from_object(self.get_object(name))

    def find(self, name: str) -> Job | None:
        try:
            return self.get(name)
        except NotFound:
            return None

    def list(self, all_namespaces: bool = False) -> list[Job]:
        if all_namespaces:
            got = self._call(f"{KIND}s", self.custom.list_cluster_custom_object, API_GROUP, _VERSION, PLURAL)
        else:
            got = self._call(f"{KIND}s", self.custom.list_namespaced_custom_object, API_GROUP, _VERSION,
                             self.namespace, PLURAL)
        return sorted((job_from_object(o) for o in got.get("items") or []), key=lambda j: (j.namespace or "", j.name))

    def delete(self, name: str) -> None:
        self._call(f"{KIND} {name}", self.custom.delete_namespaced_custom_object, API_GROUP, _VERSION,
                   self.namespace, PLURAL, name, body={"propagationPolicy": "Background"})

    def gone(self, name: str, uid: str | None) -> bool:
        """The job and every pod it had are gone (its pods are garbage-collected after it)."""
        return self.find(name) is None and not self.pods(name, uid)

    def set_suspend(self, name: str, value: bool) -> Job:
        obj = self._call(f"{KIND} {name}", self.custom.patch_namespaced_custom_object, API_GROUP, _VERSION,
                         self.namespace, PLURAL, name, {"spec": {"suspend": value}})
        return job_from_object(obj)

    def events(self, job: Job) -> list[Event]:
        got = self._call(f"events of {job.name}", self.core.list_namespaced_event, self.namespace,
                         field_selector=f"involvedObject.name={job.name},involvedObject.kind={KIND}")
        out = []
        for e in got.items:
            if job.uid and e.involved_object.uid and e.involved_object.uid != job.uid:
                continue  # a deleted job's namesake
            when = e.last_timestamp or e.event_time or e.first_timestamp or e.metadata.creation_timestamp
            out.append(Event(when.isoformat().replace("+00:00", "Z") if when else None, e.type or "", e.reason or "",
                             e.message or "", e.count or 1))
        return sorted(out, key=lambda e: e.time or "")

    # ---- pods and logs ----------------------------------------------------------------------------------------

    def pods(self, name: str, uid: str | None) -> list[PodView]:
        got = self._call(f"pods of {name}", self.core.list_namespaced_pod, self.namespace,
                         label_selector=f"{LABEL_JOB}={name}")
        return [v for p in got.items if (v := pod_view(p, uid)) is not None]

    def logs(self, name: str, selection: Selection, follow: bool) -> Iterator[str]:
        job = self.get(name)
        follower = Follower(selection, follow, job.ranks_of)
        lines: queue.Queue[tuple[str, str, bytes]] = queue.Queue()
        skip: dict[str, int] = {}
        prefixes: dict[str, str] = {}
        names: dict[str, str] = {}
        failed: dict[str, str] = {}  # pod uid -> why its log could not be read (said once)
        open_streams: set[Any] = set()
        shown = 0
        next_poll = 0.0
        try:
            while True:
                if time.monotonic() >= next_poll:
                    now = self.find(name)
                    if now is not None and now.uid == job.uid:
                        job = now
                        follower.ranks_of = job.ranks_of
                    phase = now.phase if now is not None and now.uid == job.uid else None
                    todo, done = follower.plan(self.pods(name, job.uid), phase, job.status.attempt)
                    if done:
                        if not shown and failed:
                            raise ClientError(f"logs of {name}: {next(iter(failed.values()))}")
                        return
                    for o in todo:
                        if (note := follower.announce(o)) is not None:
                            yield note
                        skip[o.pod.uid], prefixes[o.pod.uid], names[o.pod.uid] = o.skip, o.prefix, o.pod.name
                        threading.Thread(target=self._read_log, args=(o, follow, lines, open_streams), daemon=True,
                                         name=f"log-{o.pod.name}").start()
                    next_poll = time.monotonic() + self.poll
                try:
                    kind, uid, data = lines.get(timeout=max(0.01, next_poll - time.monotonic()))
                except queue.Empty:
                    continue
                if kind == "error":
                    why = data.decode("utf-8", "replace")
                    if follow and uid not in failed:
                        yield f"[seqtrain] cannot read pod {names[uid]}'s log ({why}); trying again while it runs"
                    failed[uid] = f"pod {names[uid]}: {why}"
                    continue
                if kind == "closed":
                    follower.closed(uid)
                    next_poll = 0.0  # decide at once: the job may be done, or the stream needs reopening
                    continue
                if skip[uid] > 0:
                    skip[uid] -= 1
                    continue
                follower.line(uid)
                shown += 1
                yield prefixes[uid] + data.decode("utf-8", "replace")
        finally:
            for resp in list(open_streams):  # a caller that stops reading early: end the streams' threads
                with contextlib.suppress(Exception):
                    resp.close()

    def _read_log(self, o: Open, follow: bool, out: queue.Queue[tuple[str, str, bytes]], streams: set[Any]) -> None:
        """Stream one pod's trainer log into `out` line by line, then ("closed", uid). A refused read is ("error",
        uid, why) first; a pod deleted meanwhile or a broken connection just ends the stream (the follower decides
        whether to reopen it)."""
        uid = o.pod.uid
        try:
            resp = self.core.read_namespaced_pod_log(o.pod.name, self.namespace, container=CONTAINER, follow=follow,
                                                     _preload_content=False,
                                                     _request_timeout=FOLLOW_TIMEOUT if follow else TIMEOUT)
            streams.add(resp)
            try:
                buf = b""
                for chunk in resp.stream(4096, decode_content=True):
                    buf += chunk
                    *whole, buf = buf.split(b"\n")
                    for line in whole:
                        out.put(("line", uid, line.rstrip(b"\r")))
                if buf:
                    out.put(("line", uid, buf))
            finally:
                streams.discard(resp)
                resp.release_conn()
        except ApiException as exc:
            if exc.status != 404:  # a pod deleted meanwhile is no error: its log is gone with it
                out.put(("error", uid, api_message(exc).encode()))
        except (Urllib3Error, OSError):
            pass  # a broken or timed-out connection: the follower reopens the stream if the container runs
        except Exception as exc:  # noqa: BLE001 - this thread must always report "closed", never die with a traceback
            out.put(("error", uid, f"{type(exc).__name__}: {exc}".splitlines()[0].encode()))
        finally:
            out.put(("closed", uid, b""))


def pod_view(pod: Any, uid: str | None) -> PodView | None:
    """A listed pod -> PodView; None for a pod of another job of the same name (its job-uid label differs) or one
    without the operator's attempt/replica labels."""
    labels = pod.metadata.labels or {}
    if uid and labels.get(LABEL_UID) not in (None, uid):
        return None
    try:
        attempt, replica = int(labels[LABEL_ATTEMPT]), int(labels[LABEL_REPLICA])
    except (KeyError, ValueError):
        return None
    state: ContainerState = "waiting"
    for cs in (pod.status.container_statuses or []) if pod.status else []:
        if cs.name == CONTAINER and cs.state is not None:
            state = "running" if cs.state.running else "terminated" if cs.state.terminated else "waiting"
    return PodView(pod.metadata.name, pod.metadata.uid, attempt, replica, state)
