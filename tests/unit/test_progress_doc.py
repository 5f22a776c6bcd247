"""The one progress reader (seqtrain.spec.progress_doc), what reads through it (poll, termination message, the local
backend) and what writes the document (the trainer's progress writer, metrics.jsonl, the status): hostile input is
refused in one line or made safe, and nothing seqtrain writes holds a bare NaN."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from seqtrain.spec.progress_doc import (
    MAX_DEPTH,
    MAX_DOC_BYTES,
    MAX_STAMP_AGE_SECONDS,
    ProgressError,
    Reported,
    parse_progress,
    read_progress,
)
from seqtrain.spec.status import JobStatus, Progress
from seqtrain_operator.k8s.pods.observe import progress_from_json
from seqtrain_operator.k8s.progress.poll import poll_progress
from seqtrain_operator.local.files import MetricsTail, read_status, with_trainer_progress, write_status

NOW = datetime(2026, 11, 28, 8, 0, 0, tzinfo=timezone.utc)


def doc(**fields: Any) -> bytes:
    return json.dumps({"step": 5, "totalSteps": 10, "updatedAt": "2026-11-28T07:59:50Z", **fields}).encode()


def deep(n: int) -> bytes:
    return b'{"step": 1, "x": ' + b"[" * n + b"]" * n + b"}"


REFUSED = [
    pytest.param(b"", "empty body", id="empty body"),
    pytest.param(b"   \n", "empty body", id="blank body"),
    pytest.param(b"\xff\xfe{}", "not UTF-8", id="non-UTF-8 bytes"),
    pytest.param(b'{"step": 1, "stopReason": "\xc3"}', "not UTF-8", id="cut UTF-8 sequence"),
    pytest.param(b"[1, 2]", "JSON object", id="a list"),
    pytest.param(b'"step"', "JSON object", id="a string"),
    pytest.param(b"{}", "no step", id="no step"),
    pytest.param(b'{"step": ', "not JSON", id="cut JSON"),
    pytest.param(b"{" * 5000, "nested", id="5000 open braces"),
    pytest.param(deep(5000), "nested", id="5000-deep nesting"),
    pytest.param(deep(MAX_DEPTH), "nested", id="one past the bound"),
    pytest.param(b'{"step": 1, "x": "' + b"[" * 5000 + b'"}' + b"x" * 10, "not JSON",
                 id="brackets inside a string do not nest"),
    pytest.param(doc(step=1e30), "step: 1e+30 is out of range", id="1e30 step"),
    pytest.param(doc(step=-1), "step: -1 is out of range", id="negative step"),
    pytest.param(doc(step=10**12), "out of range", id="step beyond MAX_STEPS"),
    pytest.param(b'{"step": ' + b"9" * 5001 + b"}", "out of range", id="5001-digit step"),
    pytest.param(b'{"step": NaN}', "step: expected an integer", id="NaN step"),
    pytest.param(b'{"step": Infinity}', "step: inf is out of range", id="Infinity step"),
    pytest.param(doc(step=2.5), "step: expected an integer", id="fractional step"),
    pytest.param(doc(step="5"), "step: expected an integer, got a string", id="string step"),
    pytest.param(doc(step=True), "got a boolean", id="boolean step"),
    pytest.param(doc(attempt=-3), "attempt: -3 is out of range", id="negative attempt"),
    pytest.param(doc(loss="0.5"), "loss: expected a number", id="string loss"),
    pytest.param(doc(loss=[1.0]), "loss: expected a number, got a list", id="list loss"),
    pytest.param(doc(stopReason="x" * 5000), "stopReason: a string of 5000 characters", id="huge string"),
    pytest.param(doc(stopReason={"a": 1}), "stopReason: expected a string", id="object for a string"),
    pytest.param(doc(updatedAt="yesterday"), "updatedAt", id="unparseable updatedAt"),
    pytest.param(doc(lossNonFinite="yes"), "lossNonFinite: expected true or false", id="string flag"),
    pytest.param(b"{" + b" " * (MAX_DOC_BYTES + 1) + b"}", "at most", id="over the size bound"),
]


@pytest.mark.parametrize(("raw", "reason"), REFUSED)
def test_refused_documents_get_one_line_naming_what_is_wrong(raw: bytes, reason: str) -> None:
    with pytest.raises(ProgressError) as e:
        parse_progress(raw, NOW)
    assert reason in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300
    # and the operator's readers (poll, termination message, push) see nothing, never an exception
    assert progress_from_json(raw) == Reported()


@pytest.mark.parametrize(("raw", "loss"), [
    pytest.param(b'{"step": 3, "loss": NaN}', None, id="NaN"),
    pytest.param(b'{"step": 3, "loss": Infinity}', None, id="Infinity"),
    pytest.param(b'{"step": 3, "loss": -Infinity}', None, id="-Infinity"),
    pytest.param(b'{"step": 3, "loss": 1e30}', None, id="1e30"),
    pytest.param(b'{"step": 3, "loss": 1e400}', None, id="1e400 (inf when read)"),
    pytest.param(b'{"step": 3, "loss": 2.5}', 2.5, id="finite"),
])
def test_a_non_finite_loss_becomes_null_and_says_the_run_diverges(raw: bytes, loss: float | None) -> None:
    p = parse_progress(raw, NOW).progress
    assert p is not None and p.step == 3 and p.loss == loss
    assert p.loss_non_finite is (True if loss is None else None)
    json.dumps(JobStatus(progress=p).to_dict(), allow_nan=False)


def test_other_non_finite_figures_become_null_and_keep_the_document() -> None:
    r = parse_progress(b'{"step": 4, "tokensPerSecond": NaN, "mfu": Infinity, "etaSeconds": 1e300, '
                       b'"checkpointPolicy": {"mtbfSeconds": NaN, "failures": 1}}', NOW)
    assert r.progress is not None and r.progress.step == 4
    assert r.progress.tokens_per_second is None and r.progress.mfu is None and r.progress.eta_seconds is None
    assert r.policy is not None and r.policy.mtbf_seconds is None and r.policy.failures == 1


@pytest.mark.parametrize(("stamp", "kept"), [
    (NOW - timedelta(seconds=10), True),
    (NOW - timedelta(days=29), True),  # a hung trainer's stamp keeps aging: hang detection needs it
    (NOW + timedelta(hours=3), False),
    (NOW - timedelta(seconds=MAX_STAMP_AGE_SECONDS + 60), False),
    (datetime(1970, 1, 1, tzinfo=timezone.utc), False),
])
def test_updated_at_from_the_future_or_ancient_is_clamped_to_now(stamp: datetime, kept: bool) -> None:
    text = stamp.isoformat().replace("+00:00", "Z")
    r = parse_progress(doc(updatedAt=text), NOW)
    assert r.progress is not None
    if kept:
        assert r.progress.updated_at == text and r.notes == ()
    else:
        assert r.progress.updated_at == "2026-11-28T08:00:00Z" and "updatedAt" in r.notes[0]


def test_unknown_keys_are_dropped_and_percent_is_derived() -> None:
    r = parse_progress(doc(evil="x" * 1000, percent=1e30, nested={"a": [1]}), NOW)
    assert r.progress is not None and r.progress.model_extra == {}
    d = r.progress.model_dump(by_alias=True, exclude_none=True)
    assert "evil" not in d and "nested" not in d and d["percent"] == 50.0


def test_a_malformed_sub_object_is_dropped_with_a_note_and_the_progress_kept() -> None:
    r = parse_progress(doc(lastCheckpoint={"step": 1e30, "path": "/x"}, workAtRisk="no",
                           skippedCheckpoints=[{"step": -1}, {"step": 3, "reason": "bad"}, 7]), NOW)
    assert r.progress is not None and r.checkpoint is None and r.at_risk is None
    assert r.skipped == ((3, "bad"),) and len(r.notes) == 3


def test_a_good_document_reads_whole() -> None:
    r = parse_progress(doc(loss=2.0, tokensPerSecond=1500.5, lastTokensPerSecond=1400.0, etaSeconds=30.0,
                           attempt=2, lastCheckpoint={"step": 4, "path": "/ck/step-4", "time": "2026-11-28T07:59Z"},
                           checkpointPolicy={"intervalSteps": 4, "sources": {"intervalSteps": "user"}}), NOW)
    p = r.progress
    assert p is not None and (p.step, p.total_steps, p.percent, p.loss, p.eta_seconds) == (5, 10, 50.0, 2.0, 30.0)
    assert p.tokens_per_second == 1500.5 and p.last_tokens_per_second == 1400.0 and p.attempt == 2
    assert r.checkpoint is not None and r.checkpoint.step == 4 and r.policy is not None
    assert r.policy.sources == {"intervalSteps": "user"}


def test_a_deeply_nested_decoded_document_is_refused_without_recursion() -> None:
    data: Any = []
    for _ in range(5000):
        data = [data]
    with pytest.raises(ProgressError, match="nested"):
        read_progress({"step": 1, "x": data})
    assert progress_from_json({"step": 1, "x": data}) == Reported()


def test_status_with_a_nan_loss_serialises_to_json_with_null(tmp_path: Path) -> None:
    st = JobStatus(phase="Running", progress=Progress(step=3, loss=float("nan"), tokens_per_second=float("inf")),
                   goodput=float("-inf"))
    text = json.dumps(st.to_dict(), allow_nan=False)
    back = json.loads(text)
    assert back["progress"]["loss"] is None and back["progress"]["tokensPerSecond"] is None
    assert back["goodput"] is None
    write_status(str(tmp_path), st)  # the local backend's status.json: strict JSON too
    json.loads((tmp_path / "status.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert read_status(str(tmp_path)) is not None


def _strict(text: str) -> Any:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text[:200]}"))


def test_the_trainers_progress_writer_writes_null_for_a_nan_loss(tmp_path: Path, monkeypatch) -> None:
    from seqtrain.obs.progress import ProgressReporter

    monkeypatch.delenv("SEQTRAIN_PROGRESS_PUSH_URL", raising=False)
    rep = ProgressReporter(str(tmp_path), total_steps=8)
    rep.update(flush=True, step=1, loss=2.0, tokens_per_second=100.0)
    rep.update(flush=True, step=2, loss=float("nan"), mfu=float("inf"))
    rep.update(flush=True, step=2, loss=float("nan"))  # the same step again: counted once
    rep.update(flush=True, step=3, loss=float("inf"))
    for raw in (rep.document(), (tmp_path / "progress.json").read_bytes()):
        d = _strict(raw.decode())
        assert d["step"] == 3 and "loss" not in d and d["lossNonFinite"] is True and d["nonFiniteSteps"] == 2
        assert d["percent"] == 37.5 and "mfu" not in d
        assert parse_progress(raw).progress.loss_non_finite is True  # type: ignore[union-attr]
    rep.update(flush=True, step=4, loss=1.5)
    d = _strict(rep.document().decode())
    assert d["loss"] == 1.5 and "lossNonFinite" not in d and d["nonFiniteSteps"] == 2
    rep.close()


def test_metrics_lines_are_strict_json_and_name_what_was_not_finite(tmp_path: Path) -> None:
    from seqtrain.train.metrics import MetricsWriter

    w = MetricsWriter(str(tmp_path / "metrics.jsonl"))
    w.append({"step": 1, "loss": 2.0, "tokens": 100, "step_time_s": 0.5})
    w.append({"step": 2, "loss": float("nan"), "grad_norm": float("inf"), "tokens": 100, "step_time_s": 0.5})
    w.append({"step": 3, "loss": 1.0, "tokens": 300, "step_time_s": 0.5})
    lines = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[1]["loss"] is None and lines[1]["non_finite"] == ["grad_norm", "loss"]
    assert "non_finite" not in lines[0]
    # a resume keeps steps up to the checkpoint and remembers their tokens and seconds for the run's average
    w2 = MetricsWriter(str(tmp_path / "metrics.jsonl"))
    assert w2.truncate_after(2) == 2 and (w2.kept_tokens, w2.kept_seconds) == (200, 1.0)
    # the local backend reads such a line as a diverged step
    tail = MetricsTail(str(tmp_path / "metrics.jsonl"))
    p = tail.progress()
    assert p is not None and p.step == 2 and p.loss is None and p.loss_non_finite is True
    assert p.tokens_per_second == 200.0  # tokens / training seconds of the steps in the file


def test_a_legacy_bare_nan_in_metrics_reads_as_null(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 7, "loss": NaN, "tokens_per_s": Infinity, "time": 1e30}\n')
    p = MetricsTail(str(path)).progress()
    assert p is not None and p.step == 7 and p.loss is None and p.loss_non_finite is True
    assert p.last_tokens_per_second is None and p.updated_at is None
    json.dumps(JobStatus(progress=p).to_dict(), allow_nan=False)


def test_the_local_backend_takes_the_rest_of_the_progress_from_progress_json(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 6, "loss": 1.0, "tokens_per_s": 900.0, "run_tokens_per_s": 1000.0,
                                   "eta_s": 12.0, "time": 1.8e9}) + "\n")
    pj = tmp_path / "progress.json"
    pj.write_text(json.dumps({"step": 5, "totalSteps": 8, "attempt": 2, "mfu": 0.3, "valLoss": 1.2,
                              "nonFiniteSteps": 1, "unknownField": "dropped"}))
    p = with_trainer_progress(MetricsTail(str(metrics)).progress(), str(pj))
    assert p is not None and (p.step, p.loss, p.total_steps, p.percent) == (6, 1.0, 8, 75.0)
    assert (p.tokens_per_second, p.last_tokens_per_second, p.eta_seconds) == (1000.0, 900.0, 12.0)
    assert (p.attempt, p.mfu, p.val_loss, p.non_finite_steps) == (2, 0.3, 1.2, 1) and p.model_extra == {}
    pj.write_bytes(deep(5000))  # a refused progress.json: the metrics view alone
    assert with_trainer_progress(MetricsTail(str(metrics)).progress(), str(pj)).step == 6  # type: ignore[union-attr]


def test_run_clock_averages_over_the_run_and_estimates_from_this_attempts_steps() -> None:
    from seqtrain.obs.throughput import RunClock

    clock = RunClock(total_steps=10, tokens=1000.0, seconds=1.0)  # an earlier attempt's kept steps: 1000 tok/s
    first = clock.step(6, tokens=100, seconds=1.0, now=100.0)  # this attempt's first step: 100 tok/s
    assert first == {"run_tokens_per_s": 550.0}  # no ETA from one step (start-up and restarts never count)
    out = clock.step(7, tokens=100, seconds=1.0, now=102.0)
    assert out == {"run_tokens_per_s": 400.0, "eta_s": 6.0}  # 3 steps left at 2 s of wall time each
    assert clock.step(8, tokens=float("nan"), seconds=1.0, now=104.0)["run_tokens_per_s"] == 400.0


def test_poll_reads_a_body_sent_in_two_writes_and_refuses_a_deep_one() -> None:
    async def run(body: bytes) -> Reported:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body[:10])
            await writer.drain()
            await asyncio.sleep(0.05)  # the rest in a later TCP segment
            writer.write(body[10:])
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await asyncio.wait_for(poll_progress("127.0.0.1", port, timeout=5.0), 10.0)

    good = asyncio.run(run(doc(loss=float("nan"))))
    assert good.progress is not None and good.progress.step == 5 and good.progress.loss_non_finite is True
    assert asyncio.run(run(deep(5000))) == Reported()


# ---- fuzz ------------------------------------------------------------------------------------------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                     st.text(max_size=50))
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                     max_leaves=30)
_FIELDS = list(Progress.model_fields) + ["lastCheckpoint", "checkpointPolicy", "workAtRisk", "skippedCheckpoints"]
_docs = st.dictionaries(
    st.sampled_from([Progress.model_fields[f].alias or f if f in Progress.model_fields else f for f in _FIELDS]),
    _json, max_size=8).map(lambda d: {"step": 1, **d})


def _check(raw: bytes) -> None:
    try:
        r = parse_progress(raw, NOW)
    except ProgressError as e:
        assert "\n" not in str(e) and len(str(e)) < 400
        return
    assert r.progress is not None and r.progress.step >= 0
    json.dumps(JobStatus(progress=r.progress, last_checkpoint=r.checkpoint, checkpoint_policy=r.policy,
                         work_at_risk=r.at_risk).to_dict(), allow_nan=False)


@pytest.mark.fuzz
@given(_docs)
@example({"step": 1e30})
@example({"step": None})
@example({"step": 1, "loss": float("nan"), "updatedAt": "9999-12-31T23:59:59Z"})
@example({"step": 1, "checkpointPolicy": {"sources": {"a": []}}})
def test_fuzz_progress_documents(data: dict[str, Any]) -> None:
    _check(json.dumps(data).encode())
    assert isinstance(progress_from_json(data), Reported)


@pytest.mark.fuzz
@given(_json)
def test_fuzz_any_json(data: Any) -> None:
    _check(json.dumps(data).encode())
    assert isinstance(progress_from_json(data), Reported)


@pytest.mark.fuzz
@given(st.binary(max_size=2000))
@example(b"[" * 5000)
@example(b'{"step": 1, "x": "\\' + b"[" * 50)
def test_fuzz_raw_bytes(raw: bytes) -> None:
    _check(raw)
    assert isinstance(progress_from_json(raw), Reported)


@pytest.mark.fuzz
@given(st.integers(min_value=0, max_value=6000), st.sampled_from([b"[", b"{\"a\":", b"[\"]\","]))
def test_fuzz_nesting(depth: int, opener: bytes) -> None:
    raw = b'{"step": 1, "x": ' + opener * depth + b"1"
    _check(raw)
    assert isinstance(progress_from_json(raw), Reported)


def test_stamps_are_clamped_only_beyond_the_longest_hang_timeout() -> None:
    from seqtrain.spec.cluster import FaultToleranceSpec

    bound = next(m.le for m in FaultToleranceSpec.model_fields["hang_timeout_seconds"].metadata if hasattr(m, "le"))
    assert bound < MAX_STAMP_AGE_SECONDS  # a hung trainer's stamp is judged a hang before it could be clamped


def test_a_non_finite_loss_sets_the_diverging_condition_once_and_a_finite_one_clears_it() -> None:
    from seqtrain.spec import SeqTrainJob
    from seqtrain_operator.controller import Observed, decide
    from seqtrain_operator.controller.types import Event, ReplicaObservation

    job = SeqTrainJob.model_validate({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob",
                                      "metadata": {"name": "t"}, "spec": {"replicas": 1, "training": {"steps": 100}}})
    running = (ReplicaObservation(replica=0, attempt=1, phase="Running", node="node-0"),)
    st = decide(job, JobStatus(), Observed(), NOW).status
    st = decide(job, st, Observed(replicas=running), NOW).status
    nan_doc = parse_progress(b'{"step": 7, "loss": NaN, "nonFiniteSteps": 1}', NOW).progress
    d = decide(job, st, Observed(replicas=running, progress=nan_doc), NOW)
    div = next(c for c in d.status.conditions if c.type == "Diverging")
    assert (div.status, div.reason) == ("True", "NonFiniteLoss") and "step 7" in div.message
    assert [e.reason for e in d.of(Event) if e.type == "Warning"] == ["NonFiniteLoss"]
    json.dumps(d.status.to_dict(), allow_nan=False)
    again = decide(job, d.status, Observed(replicas=running, progress=nan_doc.model_copy(update={"step": 8})), NOW)
    assert not [e for e in again.of(Event) if e.reason == "NonFiniteLoss"]  # once, on the transition
    ok = decide(job, again.status, Observed(replicas=running, progress=Progress(step=9, loss=2.0)), NOW)
    assert next(c for c in ok.status.conditions if c.type == "Diverging").status == "False"


def test_a_checkpoint_of_a_diverged_step_has_strict_json_meta(tmp_path: Path) -> None:
    from seqtrain.checkpoint.publish import Publisher, publish

    tmp = tmp_path / ".tmp-step-3"
    tmp.mkdir()
    (tmp / "model.pt").write_text("x")
    publish(Publisher(str(tmp_path), keep=2, world=1), 3, str(tmp), {"loss": float("nan")})
    meta = _strict((tmp_path / "step-3" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["loss"] is None


@pytest.mark.parametrize("message", ['{"step": 30, "totalSteps": 30, "loss": NaN}',
                                     '{"step": 30, "totalSteps": 30, "loss": Infinity, "mfu": NaN}'])
def test_a_final_progress_with_a_nan_loss_still_gives_a_writable_status(message: str) -> None:
    """The termination message is the trainer's final word: if it held a NaN the status with it could never be
    written, and the job's end would never be recorded."""
    from seqtrain_operator.k8s.pods.manifests import CONTAINER, LABEL_ATTEMPT, LABEL_REPLICA
    from seqtrain_operator.k8s.pods.observe import final_progress

    pod = {"metadata": {"labels": {LABEL_REPLICA: "0", LABEL_ATTEMPT: "1"}},
           "status": {"phase": "Succeeded", "containerStatuses": [
               {"name": CONTAINER, "state": {"terminated": {"exitCode": 0, "message": message}}}]}}
    p = final_progress([pod], 1).progress
    assert p is not None and p.step == 30 and p.loss is None and p.loss_non_finite is True
    json.dumps(JobStatus(phase="Succeeded", progress=p).to_dict(), allow_nan=False)
