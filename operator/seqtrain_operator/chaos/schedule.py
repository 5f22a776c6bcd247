"""The chaos soak's fault schedule: pure and seeded, so a seed names a run and a failure can be replayed.

Each kind of fault arrives as a Poisson process of its own rate (faults per hour), drawn from a generator seeded
with (seed, kind): changing one kind's rate leaves every other kind's times as they were. An event carries no
concrete target (which pods exist is only known when it fires), but a `pick` the runner turns into one among the
candidates of its `target` selector at that moment (`pick % len(candidates)`), and the kind's parameters, drawn here
too: the same seed hits the same n-th candidate with the same parameters.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# kind -> (target selector, default rate per hour: about one fault of the ranks' kinds per trainer job's life, the
# API's and the operator's many more, about 650 an hour in all). Selectors: "rank" a running rank of a trainer job;
# "pod" a running pod of any job (trainer or admission-only); "node" an agent node; "operator" the operator process;
# "api" the operator's API traffic (the fault proxy); "checkpoint" the newest checkpoint of a trainer job.
KINDS: dict[str, tuple[str, float]] = {
    "sigkill-rank": ("rank", 40.0),
    "sigstop-rank": ("rank", 15.0),  # params: cont_after (seconds) or None: never continued (a hang)
    "node-down": ("node", 12.0),  # params: up_after (seconds)
    "delete-pod": ("pod", 60.0),
    "evict-pod": ("pod", 60.0),
    "operator-kill": ("operator", 15.0),  # SIGKILL, then started again
    "operator-restart": ("operator", 15.0),  # SIGTERM (graceful), then started again
    "api-5xx": ("api", 120.0),  # params: status, times
    "api-429": ("api", 120.0),  # params: times, retry_after
    "api-slow": ("api", 60.0),  # params: delay, times
    "watch-cut": ("api", 60.0),
    "watch-gone": ("api", 40.0),  # the next watch after a cut gets 410 Gone
    "checkpoint-full": ("checkpoint", 12.0),  # ENOSPC on the checkpoint volume; params: for_s
    "checkpoint-corrupt": ("checkpoint", 15.0),  # the newest checkpoint's files garbled, then the gang killed
    "sigterm-node-loss": ("rank", 10.0),  # a pod deleted (SIGTERM save), its node lost during the save
    "nan-loss": ("rank", 15.0),  # the next micro-batch's loss on rank 0 is NaN (seqtrain.runtime.faults)
}

# Kinds the issue lists that the testbed and the trainer's fault hooks (seqtrain.runtime.faults) cannot inject (none).
NOT_INJECTABLE: dict[str, str] = {}

# Faults the trainer sees as its own failure (counted against faultTolerance.maxRestarts); the others are the
# infrastructure's (maxInfraRestarts) or touch only the operator's side.
TRAINING_FAULTS = frozenset({"sigkill-rank", "sigstop-rank", "checkpoint-corrupt"})
# A full volume fails a rank with exit 7 (storage full): the infrastructure budget pays, as for a lost node.
INFRA_FAULTS = frozenset({"node-down", "delete-pod", "evict-pod", "sigterm-node-loss", "checkpoint-full"})


@dataclass(frozen=True)
class Event:
    at: float  # seconds from the start of the soak
    kind: str
    target: str  # the selector (KINDS)
    pick: int  # which candidate: pick % len(candidates) when it fires
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _params(kind: str, rng: random.Random) -> dict[str, Any]:
    if kind == "sigstop-rank":
        return {"cont_after": round(rng.uniform(2, 20), 1) if rng.random() < 0.7 else None}
    if kind == "node-down":
        return {"up_after": round(rng.uniform(15, 60), 1)}
    if kind == "api-5xx":
        return {"status": rng.choice([500, 503]), "times": rng.randint(1, 5)}
    if kind == "api-429":
        return {"times": rng.randint(1, 5), "retry_after": rng.choice([1, 2, 3])}
    if kind == "api-slow":
        return {"delay": round(rng.uniform(1, 8), 1), "times": rng.randint(1, 5)}
    if kind == "checkpoint-full":
        return {"for_s": round(rng.uniform(5, 30), 1)}
    if kind == "sigterm-node-loss":
        return {"loss_after": round(rng.uniform(0.0, 3.0), 2), "up_after": round(rng.uniform(15, 45), 1)}
    return {}


def build(seed: int, duration_s: float, rates: Mapping[str, float] | None = None, start_s: float = 0.0) -> list[Event]:
    """The events of `duration_s` seconds (from `start_s`), sorted by time. `rates`: faults per hour by kind,
    overriding KINDS' defaults (0 switches a kind off)."""
    per_hour = {k: r for k, (_, r) in KINDS.items()} | dict(rates or {})
    unknown = sorted(set(per_hour) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kind {unknown[0]!r}: one of {', '.join(KINDS)}")
    events: list[Event] = []
    for kind, rate in per_hour.items():
        if rate < 0:
            raise ValueError(f"rate of {kind} is {rate}: faults per hour cannot be negative")
        if rate == 0:
            continue
        rng = random.Random(f"{seed}:{kind}")
        t = start_s + rng.expovariate(rate / 3600.0)
        while t < start_s + duration_s:
            events.append(Event(round(t, 3), kind, KINDS[kind][0], rng.getrandbits(31), _params(kind, rng)))
            t += rng.expovariate(rate / 3600.0)
    events.sort(key=lambda e: (e.at, e.kind))
    return events


def parse_rates(text: str) -> dict[str, float]:
    """`kind=rate,kind=rate` (faults per hour) -> a dict; a one-line ValueError naming the bad part."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, value = part.partition("=")
        kind = kind.strip()
        if not sep:
            raise ValueError(f"--rates: {part!r} is not kind=faults-per-hour (e.g. sigkill-rank=30)")
        if kind not in KINDS:
            raise ValueError(f"--rates: unknown fault kind {kind!r}; kinds: {', '.join(KINDS)}")
        try:
            out[kind] = float(value)
        except ValueError:
            raise ValueError(f"--rates: {kind}={value!r} is not a number of faults per hour") from None
        if out[kind] < 0:
            raise ValueError(f"--rates: {kind}={value} is negative; use 0 to switch the kind off")
    return out
