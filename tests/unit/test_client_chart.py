"""The chart as an OCI-install user meets it: NOTES.txt whose commands need no repository (its inline job and claim
are valid), a README generated from values.yaml (in sync, every value described), the dashboard's loss, validation
loss, tokens/s, restarts and lost-time panels querying only series that exist, trainer metrics on by default."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "seqtrain"


def chart_readme() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chart_readme", ROOT / "scripts" / "chart-readme.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chart_readme"] = module
    spec.loader.exec_module(module)
    return module


def test_the_chart_readme_is_generated_from_values_yaml() -> None:
    text = chart_readme().readme()
    assert (CHART / "README.md").read_text() == text, "run `python scripts/chart-readme.py`"
    assert "oci://ghcr.io/seqtrain/charts/seqtrain" in text and "| `operator.trainerMetricsPort` | `9460` |" in text


def test_every_chart_value_says_what_it_does() -> None:
    assert chart_readme().undescribed((CHART / "values.yaml").read_text()) == []


def test_descriptions_come_from_the_block_above_and_the_inline_comment() -> None:
    m = chart_readme()
    text = ("# about a\n"
            "a:\n"
            "  # about b,\n"
            "  # two lines\n"
            "  b: 1   # inline\n"
            "         # continued\n"
            "\n"
            "  c: 'x # not a comment'\n"
            "d: [1, 2]\n")
    assert m.descriptions(text) == {"a": "about a", "a.b": "about b,\ntwo lines\ninline continued"}
    assert m.undescribed(text) == ["a.c", "d"]


def test_the_replica_comment_says_what_replica_count_1_does() -> None:
    values = (CHART / "values.yaml").read_text()
    assert "Two replicas stand by for each other" not in values
    assert yaml.safe_load(values)["replicaCount"] == 1


def _helm() -> str:
    path = ROOT / ".tools" / "bin" / "helm"
    if not path.exists():
        pytest.skip("helm not installed: run `make tools`")
    return str(path)


@pytest.mark.slow
def test_install_notes_give_a_first_job_and_its_claim_without_the_repository() -> None:
    from seqtrain.spec import parse_job

    out = subprocess.run([_helm(), "install", "--dry-run=client", "seqtrain", str(CHART), "-n", "seqtrain-system"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    notes = out.split("NOTES:\n", 1)[1]
    assert "examples/" not in notes  # a repository path an OCI user does not have
    docs = [yaml.safe_load(d) for d in re.findall(r"kubectl apply -f - <<EOF\n(.*?)\n\s*EOF", notes, re.S)]
    job, claim = docs
    assert parse_job(job).spec.checkpoint.pvc is None  # the no-storage job is valid as printed
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert f"pvc: {claim['metadata']['name']}" in notes
    for command in ("seqtrain submit", "seqtrain logs first-job -f", "seqtrain status first-job", "seqtrain wait"):
        assert command in notes


@pytest.mark.slow
def test_trainer_metrics_are_on_by_default() -> None:
    out = subprocess.run([_helm(), "template", "rel", str(CHART), "-n", "seqtrain-system"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    deploy = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    assert "--trainer-metrics-port=9460" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_dashboard_shows_loss_validation_loss_tokens_restarts_and_lost_time_from_real_series() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_chart import exported_series, promql_metric_names

    dashboard = json.loads((CHART / "dashboards" / "seqtrain-goodput.json").read_text())
    exported = exported_series()
    by_title: dict[str, set[str]] = {}
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        names = set().union(*(promql_metric_names(t["expr"]) for t in p["targets"]))
        assert names and names <= exported, f"{p['title']}: {sorted(names - exported)} exported by nothing"
        by_title[p["title"]] = names
    assert by_title["Training loss"] == {"seqtrain_loss"}
    assert by_title["Validation loss"] == {"seqtrain_validation_loss"}
    used = set().union(*by_title.values())
    assert {"seqtrain_job_tokens_per_second", "seqtrain_job_restarts", "seqtrain_job_lost_seconds"} <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
