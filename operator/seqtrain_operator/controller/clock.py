"""Timestamps in status: RFC 3339 UTC strings with milliseconds (Kubernetes accepts them; backoff needs < 1 s)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone


def iso(t: datetime) -> str:
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def seconds_between(earlier: datetime, later: datetime) -> float:
    return (later - earlier) / timedelta(seconds=1)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)
