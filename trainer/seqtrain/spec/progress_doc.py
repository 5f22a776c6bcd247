"""The progress document (`status.progress`'s shape, written by rank 0: seqtrain.obs.progress): its one reader.

Both backends read it through here, torch-free: the Kubernetes operator from a poll (`GET /progress`), a push
(`POST /v1/progress/...`) or a pod's termination message; the local backend from `<workdir>/progress.json` and
metrics.jsonl. The document comes from the user's pod (or anything that can reach the operator's push port), so
nothing in it is trusted:

- size: at most MAX_DOC_BYTES; nesting: at most MAX_DEPTH, checked on the raw bytes before `json.loads` (a
  5000-deep document would otherwise end in RecursionError, in the decoder or any code walking the result);
- text: UTF-8; strings at most MAX_STRING characters; only the fields the status models know are kept (an unknown
  key is dropped: the status is the operator's to write, not the pod's);
- integers (steps, counts): JSON integers in 0..MAX_STEPS, else the document is refused: a step of 1e30 or -1
  would drive restarts, lost-time accounting and hang detection;
- numbers: a non-finite figure (NaN, Infinity, or beyond its bound: a diverged loss of 1e30) becomes null, never
  kept (the API server refuses a bare NaN in a status write, which would wedge the job: status first, then act);
  a loss read so sets `lossNonFinite` (the run is diverging);
- `updatedAt`: ISO-8601; one from the future or older than MAX_STAMP_AGE_SECONDS is clamped to now (see
  `_stamp`). `percent` is derived here from step and totalSteps, never taken from the document.

`parse_progress(raw)` returns a `Reported` or raises `ProgressError` with a one-line reason; `reported_or_nothing`
is the same for a reader that shows what it can (an empty `Reported` for a refused document). A metrics.jsonl record
(rank 0 appends one per step) says the latest step's part of the document: `read_metrics_record` reads it through
the same bounds, and `with_latest_step` lays it over the last progress.json.
"""

from __future__ import annotations

import json
import math
import re
import types
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from itertools import accumulate
from typing import Any, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from seqtrain.spec.base import MAX_STEPS
from seqtrain.spec.status import CheckpointPolicy, CheckpointRef, Progress, WorkAtRisk, json_safe

MAX_DOC_BYTES = 64 * 1024  # a real document is well under 2 KiB
MAX_DEPTH = 8  # the trainer's document nests 3 deep (checkpointPolicy.sources, skippedCheckpoints[i])
MAX_STRING = 4096  # a checkpoint path (PATH_MAX) is the longest string the trainer writes
MAX_SKIPPED = 256  # skippedCheckpoints entries kept
MAX_FIGURE = 1e15  # any other number (seconds, tokens/s, MFU ...): beyond this it is not a measurement
MAX_LOSS = 1e9  # a loss beyond this is a diverged run, as NaN is: reported as lossNonFinite
# Above faultTolerance.hangTimeoutSeconds' maximum (30 days): a hung trainer's stamp is always judged a hang before
# it could be clamped.
MAX_STAMP_AGE_SECONDS = 31 * 24 * 3600
_LOSSES = frozenset({"loss", "val_loss", "best_val_loss"})
# Derived by the reader from other fields, never taken from the document.
_DERIVED = frozenset({"percent", "step_display", "eta_display"})


class ProgressError(ValueError):
    """A document that is refused; str() is one line naming the field and what is wrong with it."""


class Reported(NamedTuple):
    """What the trainer's progress document says: its progress, the latest complete checkpoint it reports
    (`lastCheckpoint: {step, path, time}`), the checkpoints it set aside as unusable (`skippedCheckpoints:
    [{step, reason}]`), its checkpoint interval (`checkpointPolicy`), what a failure now would lose
    (`workAtRisk`), and what the reader changed on the way (`notes`: a clamped updatedAt, a dropped sub-object)."""

    progress: Progress | None = None
    checkpoint: CheckpointRef | None = None
    skipped: tuple[tuple[int, str], ...] = ()
    policy: CheckpointPolicy | None = None
    at_risk: WorkAtRisk | None = None
    notes: tuple[str, ...] = ()


def parse_progress(raw: bytes | str, now: datetime | None = None) -> Reported:
    """A progress document's bytes -> what it reports; raises ProgressError (one line) for anything else."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if not raw.strip():
        raise ProgressError("empty body: expected a progress document (a JSON object with a step)")
    if len(raw) > MAX_DOC_BYTES:
        raise ProgressError(f"a progress document is at most {MAX_DOC_BYTES} bytes, this one is {len(raw)}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProgressError(f"not UTF-8 (byte {e.start}): a progress document is UTF-8 JSON") from None
    _check_depth(text)
    try:
        data = json.loads(text, parse_int=_bounded_int)
    except ValueError as e:
        raise ProgressError(f"not JSON: {str(e).splitlines()[0][:200]}") from None
    return _read(data, now)


def read_progress(data: Any, now: datetime | None = None) -> Reported:
    """An already-decoded progress document (a dict) -> what it reports; raises ProgressError (one line)."""
    if _depth(data) > MAX_DEPTH:
        raise ProgressError(f"nested more than {MAX_DEPTH} deep: not a progress document")
    return _read(data, now)


def _read(data: Any, now: datetime | None) -> Reported:
    if not isinstance(data, Mapping):
        raise ProgressError(f"a progress document is a JSON object, not {_kind(data)}")
    if data.get("step") is None:
        raise ProgressError("no step: a progress document names the step it reports")
    notes: list[str] = []
    fields = _clean(Progress, data, "", exclude=_DERIVED)
    loss = data.get("loss")
    if loss is not None and fields.get("loss") is None:
        fields["lossNonFinite"] = True  # NaN, Infinity or beyond MAX_LOSS: diverging
    if fields.get("updatedAt") is not None:
        fields["updatedAt"], note = _stamp(fields["updatedAt"], now)
        if note:
            notes.append(note)
    total, step = fields.get("totalSteps") or 0, fields["step"]
    if total > 0:
        fields["percent"] = round(min(100.0, 100.0 * step / total), 1)
    try:
        progress = Progress.model_validate(fields)
    except ValidationError as e:  # not expected after _clean: kept one line all the same
        raise ProgressError(f"progress: {_first_error(e)}") from None
    checkpoint = _sub(CheckpointRef, data.get("lastCheckpoint"), "lastCheckpoint", notes)
    policy = _sub(CheckpointPolicy, data.get("checkpointPolicy"), "checkpointPolicy", notes)
    at_risk = _sub(WorkAtRisk, data.get("workAtRisk"), "workAtRisk", notes)
    return Reported(progress, checkpoint, _skipped(data.get("skippedCheckpoints"), notes), policy, at_risk,
                    tuple(notes))


def reported_or_nothing(data: bytes | str | Mapping[str, Any]) -> Reported:
    """A progress document, raw or decoded -> what it reports; `Reported()` (nothing) for one that is refused."""
    try:
        return parse_progress(data) if isinstance(data, bytes | str) else read_progress(data)
    except ProgressError:
        return Reported()


# A metrics.jsonl record's keys (seqtrain.train.loop.step_metrics, plus the loop's run averages) -> the progress
# document's: the part of the progress each step's record says.
METRICS_RECORD_FIELDS = {"step": "step", "loss": "loss", "tokens_per_s": "lastTokensPerSecond",
                         "run_tokens_per_s": "tokensPerSecond", "eta_s": "etaSeconds", "time": "updatedAt"}
# Of those, what the record alone knows of the latest step (progress.json is rewritten at most every second); the
# run's averages (tokensPerSecond, etaSeconds) are taken from it only where it has them.
_LATEST_ONLY = ("step", "loss", "loss_non_finite", "last_tokens_per_second", "updated_at")
_WHERE_GIVEN = ("tokens_per_second", "eta_seconds")


def read_metrics_record(rec: Mapping[str, Any], run_tokens_per_s: float | None = None) -> Progress:
    """One metrics.jsonl record -> its Progress, through the document's bounds (a non-finite loss is lossNonFinite,
    the record's `time` an updatedAt); `run_tokens_per_s` where the record has no run average of its own. Raises
    ProgressError (one line) for a record a trainer does not write."""
    if not isinstance(rec, Mapping):
        raise ProgressError(f"a metrics record is a JSON object, not {_kind(rec)}")
    doc: dict[str, Any] = {key: rec.get(name) for name, key in METRICS_RECORD_FIELDS.items()}
    if "run_tokens_per_s" not in rec:
        doc["tokensPerSecond"] = run_tokens_per_s
    t = doc["updatedAt"]
    doc["updatedAt"] = (datetime.fromtimestamp(float(t), timezone.utc).isoformat(timespec="milliseconds")
                        .replace("+00:00", "Z") if isinstance(t, int | float) and not isinstance(t, bool)
                        and 0 <= t < 1e11 else None)
    if "loss" in (rec.get("non_finite") or ()):
        doc["lossNonFinite"] = True
    progress = read_progress(doc).progress
    assert progress is not None  # _read returns one or raises
    return progress


def with_latest_step(document: Progress | None, latest: Progress) -> Progress:
    """The last progress.json's progress with the latest step laid over it (what only the metrics record knows
    yet, and the run's averages where the record has them); the percent follows the step."""
    if document is None:
        return latest
    out = document.model_copy()
    for name in _LATEST_ONLY:
        setattr(out, name, getattr(latest, name))
    for name in _WHERE_GIVEN:
        if getattr(latest, name) is not None:
            setattr(out, name, getattr(latest, name))
    out.percent = round(min(100.0, 100.0 * out.step / out.total_steps), 1) if out.total_steps > 0 else None
    return out


def read_checkpoint_report(data: Any) -> tuple[CheckpointPolicy | None, WorkAtRisk | None]:
    """`checkpointPolicy` and `workAtRisk` of a progress document (None for what is absent or malformed)."""
    if not isinstance(data, Mapping) or _depth(data) > MAX_DEPTH:
        return None, None
    notes: list[str] = []
    return (_sub(CheckpointPolicy, data.get("checkpointPolicy"), "checkpointPolicy", notes),
            _sub(WorkAtRisk, data.get("workAtRisk"), "workAtRisk", notes))


def dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps` of `json_safe(obj)`: never a bare NaN or Infinity."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


# ---- bounds ---------------------------------------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.S)
_NEST = {"[": 1, "{": 1, "]": -1, "}": -1}


def _check_depth(text: str) -> None:
    """Refuse nesting beyond MAX_DEPTH before anything recursive sees the text. Strings are cut out first (a
    bracket inside one does not nest); the rest is counted in C (accumulate), linear in the size."""
    if "[" not in text and "{" not in text:
        return
    bare = _STRING.sub("", text)
    steps = [_NEST[c] for c in bare if c in _NEST]
    if steps and max(accumulate(steps)) > MAX_DEPTH:
        raise ProgressError(f"nested more than {MAX_DEPTH} deep: not a progress document")


def _depth(obj: Any) -> int:
    """Nesting depth of decoded JSON, iteratively (never a RecursionError), stopping once past MAX_DEPTH."""
    deepest, level = 0, [obj]
    while level:
        containers = [v for v in level if type(v) in (dict, list) or isinstance(v, Mapping | list | tuple)]
        if not containers:
            return deepest
        deepest += 1
        if deepest > MAX_DEPTH:
            return deepest
        level = [v for c in containers for v in (c.values() if isinstance(c, Mapping) else c)]
    return deepest


def _bounded_int(text: str) -> int | float:
    # A 5000-digit integer is neither a step nor worth int()'s time: read as a float (inf), refused or nulled below.
    return int(text) if len(text) <= 20 else float(text)


def _kinds(annotation: Any) -> set[type]:
    if get_origin(annotation) in (Union, types.UnionType):
        return {k for a in get_args(annotation) for k in _kinds(a)}
    origin = get_origin(annotation)
    return {origin if origin is not None else annotation}


def _clean(model: type[BaseModel], data: Mapping[str, Any], where: str,
           exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The document's fields of `model` (by their camelCase names), each checked against its type and bounds.
    A wrong type, a string too long or an integer out of range raises ProgressError; a number that is not finite
    (or beyond its bound) becomes None."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        if name in exclude or key not in data or data[key] is None:
            continue
        value, kinds, label = data[key], _kinds(field.annotation), f"{where}{key}"
        if bool in kinds:
            if not isinstance(value, bool):
                raise ProgressError(f"{label}: expected true or false, got {_kind(value)}")
        elif int in kinds:
            out[key] = _count(value, label)
            continue
        elif float in kinds:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ProgressError(f"{label}: expected a number, got {_kind(value)}")
            bound = MAX_LOSS if name in _LOSSES else MAX_FIGURE
            out[key] = float(value) if math.isfinite(value) and abs(value) <= bound else None
            continue
        elif str in kinds:
            if not isinstance(value, str):
                raise ProgressError(f"{label}: expected a string, got {_kind(value)}")
            if len(value) > MAX_STRING:
                raise ProgressError(f"{label}: a string of {len(value)} characters, at most {MAX_STRING}")
        elif dict in kinds:
            value = _string_map(value, label)
        else:
            continue  # a field type the document never carries
        out[key] = value
    return out


def _count(value: Any, label: str) -> int:
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_STEPS:
        value = int(value)
    if isinstance(value, float) and (value.is_integer() or math.isinf(value)):
        raise ProgressError(f"{label}: {value:g} is out of range (0..{MAX_STEPS})")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProgressError(f"{label}: expected an integer, got {_kind(value)}")
    if not 0 <= value <= MAX_STEPS:
        raise ProgressError(f"{label}: {_short(value)} is out of range (0..{MAX_STEPS})")
    return value


def _string_map(value: Any, label: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or len(value) > 64:
        raise ProgressError(f"{label}: expected an object of at most 64 strings")
    out = {}
    for k, v in value.items():
        if not isinstance(v, str) or len(k) > 256 or len(v) > 256:
            raise ProgressError(f"{label}.{k[:64]}: expected a string of at most 256 characters")
        out[k] = v
    return out


def _sub(model: type[BaseModel], value: Any, label: str, notes: list[str]) -> Any:
    """An optional sub-object: a malformed one is dropped with a note, the rest of the document still counts."""
    if value is None:
        return None
    try:
        if not isinstance(value, Mapping):
            raise ProgressError(f"{label}: expected an object, got {_kind(value)}")
        return model.model_validate(_clean(model, value, f"{label}."))
    except ProgressError as e:
        notes.append(f"dropped {e}")
    except ValidationError as e:
        notes.append(f"dropped {label}: {_first_error(e)}")
    return None


def _skipped(value: Any, notes: list[str]) -> tuple[tuple[int, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        notes.append(f"dropped skippedCheckpoints: expected a list, got {_kind(value)}")
        return ()
    out = []
    for item in value[:MAX_SKIPPED]:
        if not isinstance(item, Mapping):
            continue
        try:
            step = _count(item.get("step"), "skippedCheckpoints[].step")
        except ProgressError as e:
            notes.append(f"dropped {e}")
            continue
        reason = item.get("reason")
        out.append((step, reason[:MAX_STRING] if isinstance(reason, str) and reason else "unusable"))
    return tuple(out)


def _stamp(text: str, now: datetime | None) -> tuple[str, str]:
    """updatedAt, and a note when it was clamped. A stamp from the future or older than MAX_STAMP_AGE_SECONDS says
    nothing about when the step happened (a node clock that is off, a forged document), and is clamped to `now`
    rather than refused: refusing every document from a node whose clock runs ahead would leave the operator's
    last stamp to age until it declared the healthy gang hung. The cost is bounded: a hung trainer repeats one
    stamp, and a future one stops being future once the clock passes it (hang detection is late by the skew, and
    a stale one is judged hung long before MAX_STAMP_AGE_SECONDS, above the longest hang timeout). An unparseable
    stamp is refused (it is not the trainer's)."""
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ProgressError(f"updatedAt: {text[:64]!r} is not an ISO-8601 time") from None
    t = t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    if now - timedelta(seconds=MAX_STAMP_AGE_SECONDS) <= t <= now + timedelta(seconds=1):
        return text, ""
    clamped = now.astimezone(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    when = "in the future" if t > now else f"older than {MAX_STAMP_AGE_SECONDS // 86400} days"
    return clamped, f"updatedAt {text[:64]} is {when}: taken as {clamped}"


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} characters)"


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
