"""What the client returns and raises: typed views of a SeqTrainJob built from the status models the CRD uses.

Torch-free and I/O-free: the Kubernetes and local backends build these from a custom resource or a run folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from seqtrain.spec.status import TERMINAL_PHASES, JobStatus
from seqtrain_operator.controller.clock import parse

# Exit codes of the cluster commands (seqtrain_operator.cli keeps 0/1/2 for every command): 0 done as asked,
# 1 the job ended otherwise or the cluster said no, 2 invalid input (nothing created), 124 a wait timed out
# (timeout(1)'s code).
EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_TIMEOUT = 0, 1, 2, 124


class ClientError(Exception):
    """A problem the user fixes: one line, `exit_code` for the CLI."""

    exit_code = EXIT_FAILED


class InvalidJob(ClientError):
    """The spec failed local validation (or the API server's admission): nothing was created. `problems`: one line
    each, `path: message`."""

    exit_code = EXIT_INVALID

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, list(problems)
        super().__init__("; ".join(f"{source}: {p}" for p in problems))


class NoCluster(ClientError):
    """No kubeconfig/context to use, or the cluster does not answer."""


class NotFound(ClientError):
    pass


class WaitTimeout(ClientError):
    exit_code = EXIT_TIMEOUT

    def __init__(self, message: str, job: Job | None = None):
        super().__init__(message)
        self.job = job


class JobEnded(ClientError):
    """`wait` for a phase the job can no longer reach: it ended (Succeeded or Failed) otherwise."""

    def __init__(self, job: Job, wanted: tuple[str, ...]):
        self.job = job
        super().__init__(f"{job.name}: ended {job.phase}, not {' or '.join(wanted)}"
                         + (f": {job.status.message}" if job.status.message else ""))


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event about the job (or a line of a local run's events.jsonl)."""

    time: str | None
    type: str
    reason: str
    message: str
    count: int = 1


@dataclass(frozen=True)
class Job:
    """One SeqTrainJob as the client sees it: identity, the spec as stored, and the typed status."""

    name: str
    namespace: str | None
    status: JobStatus
    spec: Mapping[str, Any] = field(default_factory=dict)
    uid: str | None = None
    created: str | None = None
    workdir: str | None = None  # local jobs: the run folder

    @property
    def phase(self) -> str:
        return self.status.phase

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def suspended(self) -> bool:
        return bool(self.spec.get("suspend"))

    @property
    def step(self) -> int:
        return self.status.progress.step if self.status.progress else 0

    @property
    def total_steps(self) -> int:
        p = self.status.progress
        if p is not None and p.total_steps:
            return p.total_steps
        return int((self.spec.get("training") or {}).get("steps") or 0)

    @property
    def created_at(self) -> datetime | None:
        return parse(self.created)

    @property
    def procs_per_replica(self) -> int:
        """Rank processes in one pod (replica): the status's worldSize / replicas, else the spec's."""
        st = self.status
        if st.world_size and st.replicas:
            return max(1, st.world_size // st.replicas)
        res = self.spec.get("resources") or {}
        return int(res.get("processesPerReplica") or res.get("gpus") or 1)

    def ranks_of(self, replica: int) -> tuple[int, ...]:
        """The global ranks replica `replica` runs (its placement when the status has it)."""
        for p in self.status.placement:
            if p.replica == replica and p.ranks:
                return tuple(p.ranks)
        n = self.procs_per_replica
        return tuple(range(replica * n, replica * n + n))


def job_from_object(obj: Mapping[str, Any]) -> Job:
    """A custom resource (as the API returns it) -> Job. A status this version cannot read is shown as Pending with
    the problem as its message rather than failing the command."""
    meta = obj.get("metadata") or {}
    raw = obj.get("status") or {}
    try:
        status = JobStatus.model_validate(raw)
    except ValidationError as err:
        status = JobStatus(message=f"status not readable by this seqtrain ({err.error_count()} problem(s)): "
                                   "upgrade the client")
    return Job(name=meta.get("name", ""), namespace=meta.get("namespace"), status=status,
               spec=obj.get("spec") or {}, uid=meta.get("uid"), created=meta.get("creationTimestamp"))
