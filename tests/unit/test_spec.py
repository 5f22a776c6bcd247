"""Spec validation: good files pass, every kind of bad input gives `path: message` lines naming the fix."""

from __future__ import annotations

import pathlib
import textwrap

import pytest
import yaml

from seqtrain.spec import SpecError, load_job, load_jobs, parse_job, resolve
from seqtrain.spec.load import apply_overrides

ROOT = pathlib.Path(__file__).resolve().parents[2]

BASE = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: t}
spec:
  replicas: 2
  model: {arch: gpt, preset: tiny}
  data: {seqLen: 64}
  training: {steps: 10, globalBatchSize: 8, microBatchSize: 4}
"""


def problems(text: str, sets: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(SpecError) as exc:
        load_job(textwrap.dedent(text), sets)
    return [str(p) for p in exc.value.problems]


def with_spec(**patch) -> str:
    doc = yaml.safe_load(BASE)
    for dotted, value in patch.items():
        apply_overrides(doc, [f"{dotted.replace('__', '.')}={yaml.safe_dump(value, default_flow_style=True).strip()}"])
    return yaml.safe_dump(doc)


def test_minimal_job_gets_defaults():
    job = load_job("apiVersion: seqtrain.dev/v1alpha1\nkind: SeqTrainJob\nmetadata: {name: x}\n")
    assert job.spec.replicas == 1
    assert job.spec.model.arch == "gpt"
    assert job.spec.fault_tolerance.max_restarts == 3
    assert job.spec.resources.procs == 1


def test_every_example_is_valid():
    files = sorted((ROOT / "examples").glob("*.yaml"))
    assert files, "examples/ must hold SeqTrainJob files"
    for f in files:
        for job in load_jobs(f.read_text()):
            assert job.name


def test_resolve_fills_preset_and_vocab():
    job = resolve(load_job(BASE))
    m = job.spec.model
    assert (m.dim, m.layers, m.heads, m.vocab_size, m.max_seq_len) == (64, 2, 4, 256, 64)
    # explicit values beat the preset
    job = resolve(load_job(with_spec(spec__model__dim=96, spec__model__heads=3)))
    assert (job.spec.model.dim, job.spec.model.heads, job.spec.model.layers) == (96, 3, 2)


def test_derived_degrees():
    job = load_job(BASE)
    assert job.spec.world_size == 2 and job.spec.dp == 2 and job.spec.grad_accum == 1
    job = load_job(BASE, ["training.globalBatchSize=32"])
    assert job.spec.grad_accum == 4


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a: [unclosed", "<yaml>: line"),
        ("", "<yaml>: the file holds no YAML document"),
        ("- 1\n- 2\n", "<document>: expected a mapping"),
        (BASE.replace("seqtrain.dev/v1alpha1", "batch/v1"), "apiVersion: must be seqtrain.dev/v1alpha1"),
        (BASE.replace("kind: SeqTrainJob", "kind: Job"), "kind: must be SeqTrainJob"),
        (BASE.replace("name: t", "name: Not_Valid"), "metadata.name: 'Not_Valid' cannot name the job's Service: it must be a DNS-1035 label"),
        (BASE.replace("replicas: 2", "replicas: 0"), "spec.replicas: Input should be greater than or equal to 1 (got 0)"),
        (BASE.replace("replicas: 2", "replicas: -3"), "spec.replicas: Input should be greater than or equal to 1"),
        (BASE.replace("replicas: 2", "replica: 2"), "spec.replica: unknown field; did you mean 'replicas'?"),
        (BASE.replace("arch: gpt", "arch: transformer"), "spec.model.arch: Input should be 'gpt', 'lstm', 'gru' or 'qrnn'"),
        (BASE.replace("steps: 10", "steps: ten"), "spec.training.steps: Input should be a valid integer"),
        (BASE + "  resources: {memory: lots}\n", "spec.resources.memory: 'lots' is not a Kubernetes quantity"),
    ],
)
def test_bad_input_names_field(text, expected):
    found = problems(text)
    assert any(p.startswith(expected) for p in found), found


def test_all_problems_reported_at_once():
    found = problems(BASE.replace("replicas: 2", "replicas: 0").replace("steps: 10", "steps: -1"))
    assert {p.split(":")[0] for p in found} >= {"spec.replicas", "spec.training.steps"}


@pytest.mark.parametrize(
    "patch, path, hint",
    [
        # more processes than the batch can feed
        ({"spec__replicas": 4, "spec__training__globalBatchSize": 8, "spec__training__microBatchSize": 4},
         "spec.training.globalBatchSize", "use at least 16"),
        ({"spec__training__globalBatchSize": 12}, "spec.training.globalBatchSize", "multiple of microBatchSize"),
        # a sequence length the model cannot take
        ({"spec__model__maxSeqLen": 32}, "spec.data.seqLen", "use at most 32"),
        ({"spec__model__dim": 66}, "spec.model.heads", "divisible by heads"),
        ({"spec__model__heads": 4, "spec__model__kvHeads": 3}, "spec.model.kvHeads", "multiple of kvHeads"),
        ({"spec__resources__gpus": 2, "spec__resources__processesPerReplica": 1},
         "spec.resources.processesPerReplica", "must equal resources.gpus"),
        ({"spec__data__source": "text"}, "spec.data.paths", "needs at least one file"),
        ({"spec__training__schedule__warmupSteps": 50}, "spec.training.schedule.warmupSteps", "more than training.steps"),
        ({"spec__training__eval__every": 5}, "spec.training.eval.batches", "at least 1"),
    ],
)
def test_impossible_combinations(patch, path, hint):
    found = problems(with_spec(**patch))
    assert any(p.startswith(path) and hint in p for p in found), found


def test_lstm_rejects_gpt_only_fields():
    found = problems(with_spec(spec__model__arch="lstm", spec__model__heads=4))
    assert any(p.startswith("spec.model.heads: only applies to arch gpt") for p in found), found


def test_overrides_are_typed_and_validated():
    job = load_job(BASE, ["training.steps=7", "spec.model.dropout=0.1", "data.shuffle=false"])
    assert job.spec.training.steps == 7 and job.spec.model.dropout == 0.1 and job.spec.data.shuffle is False
    assert any(p.startswith("spec.training.stepz: unknown field") for p in problems(BASE, ("training.stepz=3",)))
    assert any(p.startswith("spec.training.steps: Input should be greater") for p in problems(BASE, ("training.steps=0",)))
    assert any(p.startswith("--set:") for p in problems(BASE, ("training.steps",)))


def test_wire_form_round_trips():
    job = load_job(BASE)
    again = load_job(yaml.safe_dump(job.to_dict()))
    assert again == job


def test_multi_document_files_prefix_document_number():
    text = BASE + "---\n" + BASE.replace("replicas: 2", "replicas: 0")
    with pytest.raises(SpecError) as exc:
        load_jobs(text)
    assert [str(p) for p in exc.value.problems][0].startswith("[document 2] spec.replicas")


@pytest.mark.parametrize(("value", "ok"), [(2, True), ("0.5", True), (".5", True), ("1e3", True), ("500m", True),
                                           ("8Gi", True), (0.5, False), (True, False), ("12 GB", False),
                                           ("-1", False)])
def test_quantities_are_validated_the_way_the_apiserver_will(value, ok):
    """int-or-string in the CRD: a YAML float (`cpu: 0.5`) is refused by the apiserver, so by validate too."""
    doc = yaml.safe_load(BASE)
    doc["spec"].setdefault("resources", {})["memory"] = value  # the grammar; cpu's bound refuses 8Gi CPUs
    if ok:
        assert parse_job(doc).spec.resources.memory == str(value)
    else:
        with pytest.raises(SpecError) as err:
            parse_job(doc)
        msg = "; ".join(str(p) for p in err.value.problems)
        assert "spec.resources.memory" in msg
        if isinstance(value, float):
            assert 'write it quoted, e.g. "0.5"' in msg


@pytest.mark.parametrize("name", ["lamb", "lars", "adafactor", "sgd"])
def test_cpu_offload_with_a_non_adamw_optimizer_is_rejected(name: str) -> None:
    got = problems(BASE, ("optimization.zero.stage=2", "optimization.zero.offload=cpu",
                          f"training.optimizer.name={name}"))
    assert any(p.startswith("spec.training.optimizer.name") and "offload" in p and "adamw" in p for p in got), got
    load_job(textwrap.dedent(BASE), ("optimization.zero.stage=2", "optimization.zero.offload=cpu"))  # adamw: fine
    load_job(textwrap.dedent(BASE), ("optimization.zero.stage=2", f"training.optimizer.name={name}"))  # no offload


def test_checkpoint_path_uris_are_rejected() -> None:
    got = problems(BASE, ("checkpoint.path=s3://bucket/ck",))
    assert any(p.startswith("spec.checkpoint.path") and "not supported" in p for p in got), got
    load_job(textwrap.dedent(BASE), ("checkpoint.path=/mnt/shared/ck",))
