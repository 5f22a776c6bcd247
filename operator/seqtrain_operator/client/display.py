"""Text the cluster commands print (pure): `seqtrain list`'s table and `seqtrain status`'s page."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from seqtrain.spec.status import Progress, short_duration
from seqtrain_operator.client.model import Event, Job
from seqtrain_operator.controller.clock import parse, seconds_between, utcnow
from seqtrain_operator.controller.lost_time import REASONS

LIST_COLUMNS = ("NAME", "PHASE", "STEP", "LOSS", "TOK/S", "RESTARTS", "ETA", "AGE")
# Events the status page lists as restarts: the controller's restart messages all name the checkpoint they resume
# from (controller/decide.py: "... restart 1/3 in 2s from checkpoint step 20", "ranks restarted in place ...").
_RESTART_MARK = "from checkpoint step"


def duration(seconds: float | None) -> str:
    """kubectl's short durations: 45s, 3m12s, 2h5m, 3d4h ('-' when unknown)."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    return short_duration(seconds)


def age(created: str | None, now: datetime | None = None) -> str:
    t = parse(created)
    return duration(seconds_between(t, now or utcnow())) if t else "-"


def progress_value(p: Progress | None, name: str) -> Any:
    """A progress field by its Python name, also when this version's model does not declare it yet (a newer
    operator wrote it: the status models keep unknown keys under their camelCase name)."""
    if p is None:
        return None
    if name in type(p).model_fields:
        return getattr(p, name)
    head, *rest = name.split("_")
    return (p.model_extra or {}).get(head + "".join(w.title() for w in rest))


def eta_seconds(job: Job) -> float | None:
    """The status's ETA while the job trains (a suspended or restarting job's would be stale)."""
    if job.phase != "Running":
        return None
    value = progress_value(job.status.progress, "eta_seconds")
    return float(value) if isinstance(value, (int, float)) else None


def step_text(job: Job) -> str:
    return f"{job.step}/{job.total_steps}" if job.total_steps else str(job.step)


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None and math.isfinite(value) else "-"


def list_row(job: Job, now: datetime | None = None) -> tuple[str, ...]:
    p = job.status.progress
    restarts = str(job.status.restarts + job.status.infra_restarts)
    return (job.name, job.phase, step_text(job), _num(p.loss if p else None, ".4f"),
            _num(p.tokens_per_second if p else None, ",.0f"), restarts, duration(eta_seconds(job)),
            age(job.created, now))


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns three spaces apart, like kubectl get."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["   ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    return "\n".join(lines) + "\n"


def list_table(jobs: Sequence[Job], now: datetime | None = None, namespaces: bool = False) -> str:
    """`namespaces`: a NAMESPACE column first (kubectl get -A)."""
    if namespaces:
        return table(("NAMESPACE", *LIST_COLUMNS), [(j.namespace or "-", *list_row(j, now)) for j in jobs])
    return table(LIST_COLUMNS, [list_row(j, now) for j in jobs])


def restart_events(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if _RESTART_MARK in e.message or e.reason in ("Restarted", "RestartedInPlace")]


def _when(t: str | None, now: datetime) -> str:
    return f"{age(t, now)} ago" if parse(t) else "-"


def status_text(job: Job, events: Sequence[Event] = (), now: datetime | None = None, last_events: int = 10) -> str:
    """What `seqtrain report` says of a local run, for any job: progress, conditions, restarts with their reasons,
    lost time by reason, the checkpoint, the last events."""
    now = now or utcnow()
    st, p = job.status, job.status.progress
    out: list[str] = []

    def row(label: str, text: str) -> None:
        out.append(f"{label + ':' if label else '':<12}{text}")

    where = f" (namespace {job.namespace})" if job.namespace else f" (run folder {job.workdir})" if job.workdir else ""
    row("Job", job.name + where)
    row("Phase", job.phase + (f": {st.message}" if st.message else "") + ("; spec.suspend is true" if
                                                                          job.suspended and job.phase != "Suspended"
                                                                          else ""))
    if p is not None:
        parts = [f"step {step_text(job)}"]
        pct = progress_value(p, "percent")
        if isinstance(pct, (int, float)):
            parts[0] += f" ({pct:.1f}%)"
        elif job.total_steps:
            parts[0] += f" ({100.0 * job.step / job.total_steps:.1f}%)"
        if p.loss is not None:
            parts.append(f"loss {p.loss:.4f}")
        if p.val_loss is not None:
            parts.append(f"val loss {p.val_loss:.4f}")
        if p.tokens_per_second is not None:
            parts.append(f"{p.tokens_per_second:,.0f} tok/s")
        if (eta := eta_seconds(job)) is not None:
            parts.append(f"ETA {duration(eta)}")
        if p.updated_at:
            parts.append(f"updated {_when(p.updated_at, now)}")
        row("Progress", ", ".join(parts))
        if p.stop_reason:
            row("Stopped", f"{p.stop_reason}" + (f": {p.stop_message}" if p.stop_message else ""))
    if st.world_size:
        lay = st.layout
        shape = f", layout dp={lay.dp} tp={lay.tp} pp={lay.pp}" if lay else ""
        row("Gang", f"attempt {st.attempt}, {st.replicas or len(st.placement)} replica(s), world size "
                    f"{st.world_size}{shape}")
    for pl in st.placement:
        ranks = ",".join(map(str, pl.ranks))
        row("", f"replica {pl.replica} on {pl.node} (ranks {ranks})")
    restarts = f"{st.restarts} ({st.in_place_restarts} in place)" + (
        f", infrastructure {st.infra_restarts}" if st.infra_restarts else "")
    if st.steps_lost:
        restarts += f"; steps redone per restart: {', '.join(map(str, st.steps_lost))}"
    row("Restarts", restarts)
    for e in restart_events(events):
        out.append(f"{'':<12}{_when(e.time, now):>9}  {e.reason}: {e.message}")
    ck = st.last_checkpoint
    row("Checkpoint", f"step {ck.step} at {ck.path}" + (f", saved {_when(ck.time, now)}" if ck.time else "")
        if ck else "none yet")
    if st.lost_seconds is not None:
        lost = [(r, getattr(st.lost_seconds, r)) for r in REASONS]
        text = ", ".join(f"{r.replace('_', ' ')} {duration(v)}" for r, v in lost if v >= 1) or "none"
        if st.goodput is not None:
            text += f"; goodput {100 * st.goodput:.0f}%"
        row("Lost time", text)
    if st.conditions:
        out.append("Conditions:")
        rows = [(c.type, c.status, c.reason or "-", _when(c.last_transition_time, now), c.message or "")
                for c in st.conditions]
        out.extend("  " + line for line in table(("TYPE", "STATUS", "REASON", "SINCE", "MESSAGE"),
                                                 rows).splitlines())
    if events:
        shown = list(events)[-last_events:]
        out.append(f"Events (last {len(shown)}):")
        rows = [(_when(e.time, now), e.type, e.reason, e.message + (f" (x{e.count})" if e.count > 1 else ""))
                for e in shown]
        out.extend("  " + line for line in table(("AGE", "TYPE", "REASON", "MESSAGE"), rows).splitlines())
    return "\n".join(out) + "\n"
