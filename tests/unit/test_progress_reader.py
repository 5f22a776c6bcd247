"""One progress reader: a metrics.jsonl record (local backend) and a progress document (both backends) are read by
seqtrain.spec.progress_doc, with the same bounds; the local backend keeps no field list of its own."""

from __future__ import annotations

import json
import math
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from seqtrain.spec.progress_doc import (
    METRICS_RECORD_FIELDS,
    ProgressError,
    read_metrics_record,
    reported_or_nothing,
    with_latest_step,
)
from seqtrain.spec.status import Progress
from seqtrain_operator.k8s.pods.observe import progress_from_json
from seqtrain_operator.local.files import progress_of_record, with_trainer_progress


def test_a_record_is_read_by_the_documents_rules() -> None:
    p = read_metrics_record({"step": 7, "loss": 2.5, "tokens_per_s": 1000.0, "run_tokens_per_s": 900.0,
                             "eta_s": 12.0, "time": (now := int(time.time()) - 5)})
    assert (p.step, p.loss, p.last_tokens_per_second, p.tokens_per_second, p.eta_seconds) == (7, 2.5, 1000.0,
                                                                                             900.0, 12.0)
    assert p.updated_at == datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    # a diverged loss is what the document reader makes of it; a bad step is refused, in one line
    assert read_metrics_record({"step": 1, "loss": math.inf}).loss_non_finite is True
    assert read_metrics_record({"step": 1, "loss": None, "non_finite": ["loss"]}).loss_non_finite is True
    with pytest.raises(ProgressError, match="step"):
        read_metrics_record({"step": -1})
    assert progress_of_record({"step": 2**70}) is None
    # the run's average comes from the caller only where the record has no key for it
    assert read_metrics_record({"step": 1}, run_tokens_per_s=5.0).tokens_per_second == 5.0
    assert read_metrics_record({"step": 1, "run_tokens_per_s": 8.0}, 5.0).tokens_per_second == 8.0
    assert set(METRICS_RECORD_FIELDS.values()) <= {f.alias for f in Progress.model_fields.values()}


def test_the_latest_step_is_laid_over_the_last_document(tmp_path: Path) -> None:
    doc = {"step": 5, "totalSteps": 10, "loss": 3.0, "mfu": 0.4, "attempt": 2, "tokensPerSecond": 50.0,
           "etaSeconds": 9.0, "valLoss": 2.9}
    (tmp_path / "progress.json").write_text(json.dumps(doc))
    latest = read_metrics_record({"step": 8, "loss": 2.0, "tokens_per_s": 70.0, "eta_s": None})
    merged = with_trainer_progress(latest, str(tmp_path / "progress.json"))
    assert merged is not None
    assert (merged.step, merged.loss, merged.last_tokens_per_second, merged.percent) == (8, 2.0, 70.0, 80.0)
    assert (merged.mfu, merged.attempt, merged.val_loss, merged.eta_seconds) == (0.4, 2, 2.9, 9.0)
    assert with_latest_step(None, latest) == latest
    assert with_trainer_progress(latest, str(tmp_path / "absent.json")) == latest


def test_both_backends_refuse_the_same_documents() -> None:
    for bad in (b"[1]", b"{\"step\": -1}", b"not json", "{" * 50):
        assert progress_from_json(bad) == reported_or_nothing(bad) and reported_or_nothing(bad).progress is None
    good = b'{"step": 3, "lastCheckpoint": {"step": 2, "path": "/c/step-2"}}'
    assert progress_from_json(good).checkpoint.step == 2  # type: ignore[union-attr]
