"""Which pod logs `seqtrain logs` reads, and when it is done (pure; the backends do the reading).

A job's pods change name with every gang attempt (`<job>-<attempt>-<replica>`), and a gang restarted in place keeps
its pods while the ranks inside restart. So the follower is level-based: each pass it is shown the job's pods as
listed by label now and the job itself, and answers which logs to open (with how many lines of each were already
shown, for a stream that broke off while its container still runs) and whether the job's logs are complete.

- Ranks: one rank (default 0: the pod whose replica holds it) or all of them; each line is prefixed with the
  ranks of its pod (`[rank 3]`, or `[ranks 2-3]` for a pod of several processes, whose ranks share its stdout).
- Attempts: one attempt (`attempt`), else the latest present when following starts and, when following, every
  later one as it appears (a re-created gang), so the output survives restarts of both kinds.
- Done: not following, when every chosen log was read once; following, when the job ended (Succeeded, Failed, or
  deleted) and every chosen pod that started was read to its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from seqtrain.spec.status import TERMINAL_PHASES

ContainerState = Literal["waiting", "running", "terminated"]


@dataclass(frozen=True)
class PodView:
    """What the follower needs of one pod: its attempt and replica (the operator's labels) and the trainer
    container's state."""

    name: str
    uid: str
    attempt: int
    replica: int
    state: ContainerState = "waiting"

    @property
    def started(self) -> bool:
        return self.state != "waiting"


@dataclass(frozen=True)
class Selection:
    rank: int = 0
    all_ranks: bool = False
    attempt: int | None = None


@dataclass(frozen=True)
class Open:
    """Open this pod's log; drop its first `skip` lines (shown before its stream broke off); prefix each line."""

    pod: PodView
    skip: int
    prefix: str


@dataclass
class _Stream:
    prefix: str
    lines: int = 0
    active: bool = True


def rank_prefix(ranks: Iterable[int]) -> str:
    r = sorted(ranks)
    if not r:
        return "[rank ?] "
    if len(r) == 1:
        return f"[rank {r[0]}] "
    contiguous = r == list(range(r[0], r[-1] + 1))
    return f"[ranks {r[0]}-{r[-1]}] " if contiguous else f"[ranks {','.join(map(str, r))}] "


@dataclass
class Follower:
    selection: Selection
    follow: bool
    ranks_of: Callable[[int], tuple[int, ...]]  # replica -> its global ranks
    first_attempt: int | None = None
    streams: dict[str, _Stream] = field(default_factory=dict)  # pod uid -> what was read of it
    attempts_seen: set[int] = field(default_factory=set)

    def chosen(self, pod: PodView) -> bool:
        sel = self.selection
        if sel.attempt is not None:
            if pod.attempt != sel.attempt:
                return False
        elif self.first_attempt is not None and (pod.attempt < self.first_attempt or
                                                 (not self.follow and pod.attempt != self.first_attempt)):
            return False
        return sel.all_ranks or sel.rank in self.ranks_of(pod.replica)

    def plan(self, pods: Iterable[PodView], phase: str | None, job_attempt: int = 0) -> tuple[list[Open], bool]:
        """(logs to open now, done). `phase`: the job's phase, None when the job is gone (deleted)."""
        pods = sorted(pods, key=lambda p: (p.attempt, p.replica))
        if self.first_attempt is None and self.selection.attempt is None:
            present = [p.attempt for p in pods]
            self.first_attempt = max(present) if present else (job_attempt or None)
        ended = phase is None or phase in TERMINAL_PHASES or (
            self.selection.attempt is not None and job_attempt > self.selection.attempt)
        todo: list[Open] = []
        for pod in pods:
            if not self.chosen(pod) or not pod.started:
                continue
            s = self.streams.get(pod.uid)
            if s is None:
                prefix = rank_prefix(self.ranks_of(pod.replica))
                self.streams[pod.uid] = _Stream(prefix)
                todo.append(Open(pod, 0, prefix))
            elif not s.active and self.follow and pod.state == "running" and not ended:
                # The stream broke off while the container runs on (an API server or kubelet closed it): read the
                # log again and skip what was shown.
                s.active = True
                todo.append(Open(pod, s.lines, s.prefix))
        active = any(s.active for s in self.streams.values())
        if not self.follow:
            return todo, not todo and not active
        return todo, ended and not todo and not active

    def line(self, uid: str) -> None:
        self.streams[uid].lines += 1

    def closed(self, uid: str) -> None:
        self.streams[uid].active = False

    def announce(self, o: Open) -> str | None:
        """A line marking a new attempt's logs (after the first shown), so a restart is visible in the output."""
        if o.skip or o.pod.attempt in self.attempts_seen:
            return None
        first = not self.attempts_seen
        self.attempts_seen.add(o.pod.attempt)
        return None if first else f"[seqtrain] attempt {o.pod.attempt}: the gang was re-created; following its pods"
