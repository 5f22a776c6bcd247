"""`resources.memory` on this machine, enforced the way a pod's memory limit is.

A pod's cgroup holds every process of the pod; when their memory passes the limit the kernel kills the container
(exit 137) and its status says `OOMKilled`. Here a replica's processes are its replica process and its ranks, each
the leader of its own session (the launcher starts every rank with `start_new_session`), so everything a rank
starts (compile workers, data workers) is in one of those sessions. Every pass of the runner's loop sums the
resident set of the processes in them; past the limit every one of them gets SIGKILL, and the replica is then
observed as a pod would be: Failed, exit 137, reason OOMKilled, with the limit and what was held in the message.

Differences from a cgroup, which the message does not hide: resident memory is sampled each pass (a spike shorter
than a pass is not seen; the rank's own peak, ru_maxrss in metrics.jsonl, is checked too: runner._check_memory),
and page cache and /dev/shm are not counted.
"""

from __future__ import annotations

import os
import signal
from contextlib import suppress
from dataclasses import dataclass, field, replace

from seqtrain.spec.cluster import quantity_value
from seqtrain_operator.controller.types import ReplicaObservation

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
OOM_EXIT = 128 + signal.SIGKILL  # what a container killed by the OOM killer exits with


def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f} MiB"


def session_rss(sessions: set[int], proc: str = "/proc") -> dict[int, int]:
    """Resident bytes per session leader of every process in `sessions` (from /proc/PID/stat: session, rss)."""
    out: dict[int, int] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                text = f.read().decode("ascii", "replace")
        except OSError:  # ended meanwhile
            continue
        fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ... rss (22nd)
        try:
            session, rss = int(fields[3]), int(fields[21]) * PAGE
        except (IndexError, ValueError):
            continue
        if session in sessions:
            out[session] = out.get(session, 0) + rss
    return out


@dataclass
class MemoryLimit:
    """The limit of one job (bytes per replica) and what it did: peaks seen, replicas it killed."""

    memory: str  # resources.memory as written, for the messages
    limit: int = 0
    peaks: dict[int, int] = field(default_factory=dict)  # replica -> highest sum seen
    killed: dict[tuple[int, int], str] = field(default_factory=dict)  # (attempt, replica) -> why
    enforced: bool = field(default_factory=lambda: os.path.isdir("/proc/self"))

    def __post_init__(self) -> None:
        self.limit = int(quantity_value(self.memory))

    def watch(self, attempt: int, members: list) -> list[str]:  # noqa: ANN001 - local.gang.Replica
        """One sample of every running replica of the gang; kills the replicas over the limit and returns one line
        per replica killed now."""
        if not self.enforced:
            return []
        said = []
        for m in members:
            if (attempt, m.replica) in self.killed or m.proc.poll() is not None:
                continue
            ranks = m.rank_pids()
            leaders = {m.proc.pid, *ranks.values()}
            held = session_rss(leaders)
            total = sum(held.values())
            self.peaks[m.replica] = max(self.peaks.get(m.replica, 0), total)
            if total <= self.limit:
                continue
            for pid in leaders:
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            per_rank = ", ".join(f"rank {r} {_mib(held.get(pid, 0))}" for r, pid in sorted(ranks.items()))
            why = (f"resources.memory {self.memory} ({_mib(self.limit)}) exceeded: replica {m.replica}'s processes "
                   f"held {_mib(total)} ({per_rank}) and were killed as a pod's would be")
            self.killed[(attempt, m.replica)] = why
            said.append(why)
        return said

    def observed(self, r: ReplicaObservation) -> ReplicaObservation:
        """A replica this limit killed, as a pod killed by its limit is observed."""
        why = self.killed.get((r.attempt, r.replica))
        if why is None or r.phase != "Failed":
            return r
        return replace(r, reason="OOMKilled", exit_code=OOM_EXIT, message=f"{why}; log {r.message.split('; log ')[-1]}"
                       if "; log " in r.message else why)
