"""The chaos soak's invariants, checked on every round of observation (not only at the end).

`Checker.observe` takes what the runner saw at one moment (the jobs, their pods, each trainer job's checkpoint
steps and the start lines its ranks printed since the last round) and records a `Violation` for anything that
must never happen; `Checker.finish` adds the end-of-run ones (outcome, exact losses). Deadlines come from each
job's own spec (pending grace, hang timeout, backoff) and the operator's settings, never from this machine's speed.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from seqtrain_operator.chaos.schedule import INFRA_FAULTS, TRAINING_FAULTS

START_LINE = re.compile(r"seqtrain: (\S+) attempt \d+, (?:resumed from step (\d+)|fresh start)")
TERMINAL = ("Succeeded", "Failed")
# What a Failed job's message may say for each kind of fault it was hit by (the message names the fault).
FAULT_WORDS: dict[str, str] = {
    "sigkill-rank": r"SIGKILL|exit code 137|killed",
    "sigstop-rank": r"hang|no step|stalled|SIGKILL|timeout",
    "checkpoint-full": r"No space|ENOSPC|space|exit code|checkpoint",
    "checkpoint-corrupt": r"checkpoint|SIGKILL|exit code 137",
    "node-down": r"node|evict|lost|NotReady",
    "delete-pod": r"delet|evict|pod",
    "evict-pod": r"evict|pod|delet",
    "sigterm-node-loss": r"node|delet|lost|SIGTERM|143",
}


@dataclass
class Violation:
    at: float  # seconds since the soak started
    job: str
    what: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"at": round(self.at, 1), "job": self.job, "what": self.what, "detail": self.detail}


@dataclass
class Deadlines:
    """The operator's settings the soak started it with (seconds)."""

    termination_grace: float
    node_lost_grace: float
    check_interval: float  # how long one round of observation may take to see a change


def stuck_after(spec: Mapping[str, Any], restarts: int, d: Deadlines) -> float:
    """How long a job may show no change of phase, attempt or step before it counts as stuck: the longest quiet
    stretch its own settings allow (a gang pending until its grace ends, a hang until its timeout, the backoff of its
    next restart, a lost node's grace and the old gang's termination) plus one round of observation."""
    ft = spec.get("faultTolerance") or {}
    sched = spec.get("scheduling") or {}
    backoff = min(float(ft.get("backoffSeconds", 5.0)) * 2 ** max(restarts, 0), float(ft.get("maxBackoffSeconds", 300)))
    hang = float(ft.get("hangTimeoutSeconds") or 0)
    return (float(sched.get("pendingGraceSeconds", 300)) + hang + backoff + d.node_lost_grace + d.termination_grace
            + 2 * d.check_interval)


@dataclass
class JobTrack:
    name: str
    kind: str  # "trainer" | "load" | "reference"
    spec: dict[str, Any]
    created: float
    last_change: float
    last_seen: tuple[Any, ...] = ()
    phase: str = ""
    message: str = ""
    restarts: int = 0
    infra_restarts: int = 0
    faults: list[str] = field(default_factory=list)  # kinds injected into this job
    deleted_at: float | None = None
    starts: list[int | None] = field(default_factory=list)  # resumed-from step per start line (None: from scratch)
    ckpt_history: list[set[int]] = field(default_factory=list)  # loadable checkpoint steps, per round (last 3)
    corrupted: set[int] = field(default_factory=set)
    seen_ckpts: set[int] = field(default_factory=set)
    stuck_reported: bool = False
    dup_suspect: set[str] = field(default_factory=set)
    status: dict[str, Any] = field(default_factory=dict)


@dataclass
class Checker:
    deadlines: Deadlines
    jobs: dict[str, JobTrack] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    checkpoints_lost: int = 0
    duplicate_pods: int = 0
    stuck: int = 0
    orphans: int = 0
    # The soak adds jobs from its main thread while the checker thread walks them: every walk of `jobs` that may
    # meet an insertion holds this (one 35-minute soak lost an observation round to "dictionary changed size").
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def add_job(self, name: str, kind: str, spec: dict[str, Any], now: float) -> None:
        with self.lock:
            self.jobs[name] = JobTrack(name, kind, spec, now, now)

    def tracks(self) -> list[tuple[str, JobTrack]]:
        """A copy of the jobs tracked, safe to walk while the other thread adds one."""
        with self.lock:
            return list(self.jobs.items())

    def fault(self, job: str | None, kind: str, now: float) -> None:
        """A fault hit this job (or, with job None, everything: the operator, the API): quiet time starts over."""
        for t in ([self.jobs[job]] if job in self.jobs else self.jobs.values()):
            t.last_change = max(t.last_change, now)
            if job is not None:
                t.faults.append(kind)

    def corrupted(self, job: str, step: int) -> None:
        self.jobs[job].corrupted.add(step)

    def violate(self, now: float, job: str, what: str, detail: str) -> None:
        self.violations.append(Violation(now, job, what, detail))

    def observe(self, now: float, objects: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
                checkpoints: Mapping[str, set[int]], start_lines: Mapping[str, list[str]],
                down_nodes: set[str]) -> None:
        """One round: `objects` the SeqTrainJobs that exist, `pods` every pod of the soak's namespaces,
        `checkpoints` job -> published checkpoint steps on its volume, `start_lines` job -> its ranks' new start
        lines (rank 0's), `down_nodes` agent nodes taken down now (their pods' deletions cannot be confirmed)."""
        with self.lock:
            self._observe(now, objects, pods, checkpoints, start_lines, down_nodes)

    def _observe(self, now: float, objects: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
                 checkpoints: Mapping[str, set[int]], start_lines: Mapping[str, list[str]],
                 down_nodes: set[str]) -> None:
        present = {}
        for obj in objects:
            name = obj["metadata"]["name"]
            present[name] = obj
            track = self.jobs.get(name)
            if track is None:
                continue
            st = obj.get("status") or {}
            track.status = st
            key = (st.get("phase"), st.get("attempt"), st.get("restartRound"), (st.get("progress") or {}).get("step"),
                   st.get("restarts"), st.get("infraRestarts"))
            if key != track.last_seen:
                track.last_seen, track.last_change, track.stuck_reported = key, now, False
            track.phase, track.message = st.get("phase", ""), st.get("message", "")
            track.restarts, track.infra_restarts = int(st.get("restarts") or 0), int(st.get("infraRestarts") or 0)
            limit = stuck_after(track.spec, track.restarts + track.infra_restarts, self.deadlines)
            if (track.phase not in TERMINAL and track.deleted_at is None and not track.stuck_reported
                    and now - track.last_change > limit):
                track.stuck_reported = True
                self.stuck += 1
                self.violate(now, name, "stuck", f"phase {track.phase or '-'}, no change for "
                              f"{now - track.last_change:.0f}s (its deadline {limit:.0f}s); status {st}")
        self._pods(now, pods, present, down_nodes)
        for name, steps in checkpoints.items():
            self._restarts(now, name, steps, start_lines.get(name, []))

    def _pods(self, now: float, pods: Iterable[Mapping[str, Any]], present: Mapping[str, Any],
              down_nodes: set[str]) -> None:
        live: dict[tuple[str, str], list[str]] = {}
        for pod in pods:
            meta = pod["metadata"]
            labels = meta.get("labels") or {}
            job = labels.get("seqtrain.dev/job")
            if job is None or job not in self.jobs:
                continue
            track = self.jobs[job]
            if (job not in present and track.deleted_at is not None and pod["spec"].get("nodeName") not in down_nodes
                    and now - track.deleted_at > self.deadlines.termination_grace + self.deadlines.node_lost_grace
                    + 2 * self.deadlines.check_interval):
                key = meta["uid"]
                if key not in track.dup_suspect:  # counted once per pod
                    track.dup_suspect.add(key)
                    self.orphans += 1
                    self.violate(now, job, "orphan pod", f"{meta['name']} still there "
                                  f"{now - track.deleted_at:.0f}s after its job was deleted")
                continue
            if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in TERMINAL:
                continue
            live.setdefault((job, labels.get("seqtrain.dev/replica", "?")), []).append(meta["name"])
        for (job, replica), names in live.items():
            track = self.jobs[job]
            key = f"{replica}:{','.join(sorted(names))}"
            if len(names) > 1:
                # Seen twice in a row: not a moment between the operator's delete and the list.
                if key in track.dup_suspect:
                    self.duplicate_pods += len(names) - 1
                    self.violate(now, job, "duplicate pods", f"replica {replica}: {sorted(names)} all live")
                    track.dup_suspect.discard(key)
                    track.dup_suspect.add(f"reported:{key}")
                elif f"reported:{key}" not in track.dup_suspect:
                    track.dup_suspect.add(key)

    def _restarts(self, now: float, name: str, steps: set[int], lines: list[str]) -> None:
        track = self.jobs.get(name)
        if track is None:
            return
        track.seen_ckpts |= steps
        for line in lines:
            m = START_LINE.search(line)
            if m is None:
                continue
            resumed = int(m.group(2)) if m.group(2) else None
            track.starts.append(resumed)
            # The line was read this round, so written after the previous round's log read, which came after the
            # checkpoints of the round before that were listed: those existed before this start.
            before = track.ckpt_history[0] if len(track.ckpt_history) >= 2 else set()
            loadable = before - track.corrupted
            newest = max(loadable, default=None)
            if newest is not None and (resumed is None or resumed < newest):
                self.checkpoints_lost += 1
                self.violate(now, name, "older checkpoint" if resumed is not None else "restart from scratch",
                              f"started {'from scratch' if resumed is None else f'from step {resumed}'} while "
                              f"step {newest} was loadable (published: {sorted(before)}, corrupted by the soak: "
                              f"{sorted(track.corrupted)})")
        track.ckpt_history = (track.ckpt_history + [set(steps)])[-2:]

    def finish(self, now: float, reference: Mapping[int, float] | None,
               losses: Mapping[str, tuple[dict[int, float], int]], restart_limit: Mapping[str, tuple[int, int]]) -> None:
        """End of run: every trainer job ended, Failed only past its budget and naming a fault it was hit by;
        the losses of every Succeeded trainer job equal the reference's. `losses`: job -> (step -> loss,
        steps recorded twice); `restart_limit`: job -> (maxRestarts, maxInfraRestarts)."""
        for name, track in self.jobs.items():
            if track.kind == "load":
                continue
            if track.phase not in TERMINAL:
                self.violate(now, name, "not ended", f"phase {track.phase or '-'} at the end of the soak")
                continue
            if track.phase == "Failed":
                training = sum(k in TRAINING_FAULTS for k in track.faults)
                infra = sum(k in INFRA_FAULTS for k in track.faults)
                max_r, max_i = restart_limit.get(name, (0, 0))
                if training <= max_r and infra <= max_i:
                    self.violate(now, name, "unexpected failure", f"{training} training and {infra} infrastructure "
                                  f"faults within budget ({max_r}, {max_i}): {track.message}")
                elif not any(re.search(FAULT_WORDS.get(k, "$^"), track.message, re.I) for k in set(track.faults)):
                    self.violate(now, name, "failure names no fault",
                                  f"faults {sorted(set(track.faults))}; message: {track.message}")
            if track.phase == "Succeeded" and reference is not None and name in losses:
                got, twice = losses[name]
                # A NaN loss skips its step's update: the losses after it follow another trajectory. Until it,
                # exact; the NaN step itself is recorded with no loss (null) and the job still ends.
                nan_at = min((s for s, v in got.items() if v is None or v != v), default=None) \
                    if "nan-loss" in track.faults else None
                wrong = sorted(s for s in reference if (nan_at is None or s < nan_at) and got.get(s) != reference[s])
                if wrong:
                    s = wrong[0]
                    self.violate(now, name, "wrong losses", f"{len(wrong)} steps differ from the uninterrupted run, "
                                  f"first step {s}: {got.get(s)} vs {reference[s]} (faults {track.faults})")

    def expected_failure(self, name: str, limits: tuple[int, int]) -> bool:
        track = self.jobs[name]
        return (sum(k in TRAINING_FAULTS for k in track.faults) > limits[0]
                or sum(k in INFRA_FAULTS for k in track.faults) > limits[1])
