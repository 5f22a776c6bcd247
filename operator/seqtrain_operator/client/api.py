"""`Client`: submit, get, list, logs, wait, delete, suspend and resume SeqTrainJobs, on a cluster or locally.

    from seqtrain.client import Client
    c = Client()                                  # the current kube context (Client(context=..., namespace=...))
    job = c.submit("job.yaml", set=["training.steps=200"])
    for line in c.logs(job.name, follow=True):    # rank 0, across restarts, until the job ends
        print(line)
    c.wait(job.name, "Succeeded", timeout=3600)

`Client(local=True)` runs the same calls against run folders under `runs/` (`seqtrain run` in a background process).
Every problem the user fixes is a `ClientError` (one line; `exit_code` is what the CLI exits with).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, get_args

from seqtrain.spec import SeqTrainJob, SpecError, apply_overrides, parse_job
from seqtrain.spec.load import parse_yaml_documents
from seqtrain.spec.problems import Problem
from seqtrain.spec.status import Phase
from seqtrain_operator.client.follow import Selection
from seqtrain_operator.client.model import ClientError, Event, InvalidJob, Job, JobEnded, WaitTimeout

PHASES: tuple[str, ...] = get_args(Phase)


def prepare(job: str | os.PathLike[str] | dict[str, Any] | SeqTrainJob, overrides: Iterable[str] = (),
            name: str | None = None, namespace: str | None = None) -> dict[str, Any]:
    """The document to create: the file's (or dict's) one SeqTrainJob with `name`, `namespace` and the --set
    overrides applied, validated by the rules of `seqtrain validate`. Raises InvalidJob (nothing created)."""
    if isinstance(job, SeqTrainJob):
        source, doc = job.name, job.model_dump(by_alias=True, mode="json", exclude_unset=True, exclude={"status"})
        doc.setdefault("apiVersion", job.api_version)
        doc.setdefault("kind", job.kind)
    elif isinstance(job, dict):
        source, doc = str((job.get("metadata") or {}).get("name") or "<job>"), copy.deepcopy(job)
    else:
        source = os.fspath(job)
        try:
            with open(source, encoding="utf-8") as f:
                docs = parse_yaml_documents(f.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidJob(source, [f"<file>: cannot read: {getattr(exc, 'strerror', None) or exc}"]) from None
        except SpecError as err:
            raise InvalidJob(source, [str(p) for p in err.problems]) from None
        if len(docs) != 1:
            raise InvalidJob(source, [f"<yaml>: expected exactly one SeqTrainJob, found {len(docs)} documents "
                                      "(submit one file per job)"])
        doc = docs[0]
    try:
        if not isinstance(doc, dict):
            raise SpecError([Problem("<document>", "expected a mapping (a SeqTrainJob)")])
        doc.pop("status", None)
        meta = doc.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise SpecError([Problem("metadata", "expected a mapping")])
        if name:
            meta["name"] = name
        if namespace:
            meta["namespace"] = namespace
        doc = apply_overrides(doc, list(overrides)) if overrides else doc
        parse_job(doc)
    except SpecError as err:
        raise InvalidJob(source, [str(p) for p in err.problems]) from None
    return doc


def wait_for(get: Callable[[str], Job], name: str, phases: Sequence[str], timeout: float | None,
             poll: float, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> Job:
    """Poll `get(name)` until its phase is one of `phases` (returned), it ended otherwise (JobEnded) or `timeout`
    seconds passed (WaitTimeout)."""
    deadline = None if timeout is None else clock() + timeout
    while True:
        job = get(name)
        if job.phase in phases:
            return job
        if job.done:
            raise JobEnded(job, tuple(phases))
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                raise WaitTimeout(f"{name}: still {job.phase} after {timeout:g}s, not {' or '.join(phases)}"
                                  + (f" (step {job.step}/{job.total_steps})" if job.total_steps else ""), job)
            sleep(min(poll, left))
        else:
            sleep(poll)


def phases_of(for_phase: str | Iterable[str]) -> tuple[str, ...]:
    wanted = (for_phase,) if isinstance(for_phase, str) else tuple(for_phase)
    bad = [p for p in wanted if p not in PHASES]
    if bad or not wanted:
        raise InvalidJob("--for", [f"{', '.join(bad) or '(none)'}: not a phase; one of {', '.join(PHASES)}"])
    return wanted


class Client:
    """SeqTrainJobs on the cluster of the current kube context (or `context`, `namespace`), or with `local=True`
    on this machine under `runs_dir`. Returns `Job`s whose `.status` is the CRD's JobStatus model."""

    def __init__(self, local: bool = False, context: str | None = None, namespace: str | None = None,
                 runs_dir: str = "runs", poll_seconds: float = 1.0):
        self.local = local
        self.poll = poll_seconds
        if local:
            from seqtrain_operator.client.local import LocalJobs

            self._jobs: Any = LocalJobs(runs_dir, poll_seconds=min(poll_seconds, 0.5))
        else:
            try:
                from seqtrain_operator.client.kube import KubeJobs
            except ImportError as exc:  # the torch-free core without the `operator` extra
                raise ClientError(f"the Kubernetes client is not installed ({exc.name}): pip install "
                                  "'seqtrain[operator]'") from None
            self._jobs = KubeJobs(context, namespace, poll_seconds=poll_seconds)

    @property
    def namespace(self) -> str | None:
        """The namespace calls go to (None: local)."""
        return self._jobs.namespace

    def submit(self, job: str | os.PathLike[str] | dict[str, Any] | SeqTrainJob, set: Iterable[str] = (),
               name: str | None = None, namespace: str | None = None, wait: bool = False,
               timeout: float | None = None) -> Job:
        """Validate locally (InvalidJob before anything is created), create the job, and with `wait` wait until it
        ends: returns it Succeeded, raises JobEnded when it Failed."""
        doc = prepare(job, set, name, None if self.local else namespace)
        created = self._jobs.create(doc)
        return self.wait(created.name, "Succeeded", timeout) if wait else created

    def get(self, name: str) -> Job:
        return self._jobs.get(name)

    def list(self, all_namespaces: bool = False) -> list[Job]:
        """The jobs of the client's namespace (`all_namespaces`: of every namespace), by namespace and name."""
        return self._jobs.list(all_namespaces)

    def events(self, name: str) -> list[Event]:
        """The job's events, oldest first (Kubernetes keeps them for about an hour)."""
        return self._jobs.events(self.get(name))

    def logs(self, name: str, follow: bool = False, rank: int | None = None, all_ranks: bool = False,
             attempt: int | None = None) -> Iterator[str]:
        """The trainer's output, each line prefixed with its rank(s) (`[rank 0] ...`). Default rank 0; `all_ranks`
        every rank. Without `attempt`: the latest attempt's logs, and with `follow` every later attempt's as the
        gang is restarted or re-created, until the job ends."""
        if rank is not None and all_ranks:
            raise ClientError("--rank and --all: pick one")
        if rank is not None and rank < 0:
            raise ClientError(f"--rank {rank}: must be 0 or more")
        if attempt is not None and attempt < 1:
            raise ClientError(f"--attempt {attempt}: attempts count from 1")
        self.get(name)  # NotFound before the first line
        sel = Selection(rank=rank or 0, all_ranks=all_ranks, attempt=attempt)
        return self._jobs.logs(name, sel, follow)

    def wait(self, name: str, for_phase: str | Iterable[str] = "Succeeded", timeout: float | None = None) -> Job:
        """Wait until the job's phase is `for_phase` (one phase or several): returns the job; raises JobEnded when it
        ended (Succeeded or Failed) otherwise and WaitTimeout after `timeout` seconds."""
        return wait_for(self.get, name, phases_of(for_phase), timeout, self.poll)

    def delete(self, name: str, wait: bool = False, timeout: float | None = 300.0) -> None:
        """Delete the job (its pods, Service and ConfigMaps go with it); `wait`: until all of them are gone."""
        uid = self.get(name).uid
        self._jobs.delete(name)
        if not wait:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._jobs.gone(name, uid):
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"{name}: deleted, but it or its pods are still there after {timeout:g}s")
            time.sleep(self.poll)

    def suspend(self, name: str) -> Job:
        """spec.suspend: true: the gang is stopped (ranks save a checkpoint first); the job stays, Suspended."""
        return self._jobs.set_suspend(name, True)

    def resume(self, name: str) -> Job:
        """spec.suspend: false: a new gang resumes from the latest checkpoint."""
        return self._jobs.set_suspend(name, False)
