"""`training.microBatchSize: auto`: the estimate's choice (largest divisor of globalBatchSize / dp that fits
resources.memory), and the rank's probe steps that confirm it or step down; the global batch is always kept."""

from __future__ import annotations

import pytest

from seqtrain.spec import load_job_file
from seqtrain.spec.memory import auto_micro_batch, batch_candidates, estimate, replica_need
from seqtrain.train.autobatch import Probe, beside_the_step, choose
from seqtrain_operator.planner.show import plan_command

QUICK = "examples/quickstart.yaml"
MiB = 2**20


def job(memory: str = "4Gi", *sets: str):
    return load_job_file(QUICK, ["training.microBatchSize=auto", "training.globalBatchSize=64", "replicas=1",
                                 f"resources.memory={memory}", *sets])


def test_candidates_keep_the_global_batch() -> None:
    assert batch_candidates(job()) == (64, 32, 16, 8, 4, 2, 1)
    two = load_job_file(QUICK, ["training.microBatchSize=auto", "training.globalBatchSize=24"])  # 2 replicas
    assert batch_candidates(two) == (12, 6, 4, 3, 2, 1)


@pytest.mark.parametrize("memory", ["4Gi", "900Mi", "700Mi", "600Mi"])
def test_the_estimate_picks_the_largest_candidate_that_fits(memory: str) -> None:
    j = job(memory)
    pick = auto_micro_batch(j)
    limit = load_job_file(QUICK, [f"resources.memory={memory}"]).spec.resources.memory
    from seqtrain.spec.cluster import quantity_value

    cap = float(quantity_value(limit))
    fitting = [c for c in pick.candidates if replica_need(j, estimate(j, c)) <= cap]
    assert pick.size == (fitting[0] if fitting else 1)
    assert f"microBatchSize auto -> {pick.size}, gradient accumulation {64 // pick.size}" in pick.reason \
        or not fitting
    if fitting and pick.size < 64:
        bigger = pick.candidates[pick.candidates.index(pick.size) - 1]
        assert f"({bigger} would need" in pick.reason and f"of {memory[:-2]}" in pick.reason


def test_validate_and_plan_accept_auto_and_plan_shows_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_command(QUICK, overrides=["training.microBatchSize=auto", "training.globalBatchSize=64", "replicas=1",
                                          "resources.memory=965Mi"]) == 0
    out = capsys.readouterr().out
    assert "(auto)" in out and "note: microBatchSize auto -> 32, gradient accumulation 2 (64 would need" in out


def test_auto_refuses_pipeline_parallel() -> None:
    from seqtrain.spec import SpecError

    with pytest.raises(SpecError) as err:
        load_job_file(QUICK, ["training.microBatchSize=auto", "optimization.pipelineParallel=2",
                              "model.preset=tiny"])
    assert any(p.path == "spec.training.microBatchSize" and "pipelineMicroBatches" in p.message
               for p in err.value.problems)


def _fake_probe(base: float, per_seq: float, seen: list[int]):
    """A probe whose peak grows linearly with the micro-batch; it stops (does not fit) past its budget."""
    def probe(job, size: int, device: object, budget: float | None = None) -> Probe:  # noqa: ANN001
        seen.append(size)
        peak = base + per_seq * size
        over = budget is not None and peak > budget
        return Probe(fits=not over, peak_host=min(peak, budget or peak), peak_device=0.0, over=over)
    return probe


def _agree(fits: bool, peak: float) -> tuple[bool, float]:
    return fits, peak


def test_probe_steps_down_from_the_estimates_choice_until_a_step_fits() -> None:
    j = job("965Mi")
    first = auto_micro_batch(j)
    assert first.size == 32  # the estimate: 64 needs more than 965 MiB
    seen: list[int] = []
    # the real process: 765 MiB + 6 MiB per sequence (more than the estimate says): 32 -> 957 + beside > 965 MiB
    chosen, reason = choose(j, "cpu", _agree, _fake_probe(765 * MiB, 6 * MiB, seen))
    size = chosen.spec.training.micro_batch_size
    assert seen == [32, 16] and size == 16
    assert chosen.spec.grad_accum * size * chosen.spec.dp == j.spec.training.global_batch_size == 64
    assert reason.startswith("microBatchSize auto -> 16, gradient accumulation 4 (32 does not fit")
    assert "probe step: " in reason and "965Mi" in reason
    need = (765 * MiB + 6 * MiB * 16 + beside_the_step(j, 16))
    assert need <= 965 * MiB


def test_probe_confirms_the_estimates_choice_when_it_fits() -> None:
    j = job("4Gi")
    seen: list[int] = []
    chosen, reason = choose(j, "cpu", _agree, _fake_probe(600 * MiB, 1 * MiB, seen))
    assert seen == [64] and chosen.spec.training.micro_batch_size == 64
    assert reason.startswith("microBatchSize auto -> 64, gradient accumulation 1") and "probe step:" in reason


def test_nothing_fits_trains_with_the_smallest_and_says_so() -> None:
    j = job("965Mi")
    seen: list[int] = []
    chosen, reason = choose(j, "cpu", _agree, _fake_probe(1015 * MiB, 1 * MiB, seen))
    assert chosen.spec.training.micro_batch_size == 1 and seen == [32, 16, 8, 4, 2, 1]
    assert "the smallest" in reason


def test_sharded_engines_keep_the_estimates_choice_unprobed() -> None:
    j = load_job_file(QUICK, ["training.microBatchSize=auto", "training.globalBatchSize=64",
                              "optimization.engine=native", "optimization.zero.stage=3"])
    seen: list[int] = []
    chosen, reason = choose(j, "cpu", _agree, _fake_probe(0, 0, seen))
    assert seen == [] and "not probed: engine fsdp2" in reason
    assert chosen.spec.training.micro_batch_size == auto_micro_batch(j).size


def test_the_auto_choice_travels_in_the_progress_document_to_either_backend():
    """A pod's operator reads no rank log: the choice and its reason go into the progress document rank 0 publishes,
    which both backends read into status.progress."""
    from types import SimpleNamespace

    from seqtrain.obs.callbacks import ProgressPublisher
    from seqtrain.spec.progress_doc import read_progress
    from seqtrain.spec.status import Progress

    why = "microBatchSize auto -> 16, gradient accumulation 4 (probe 839 MiB of 900 MiB)"
    trainer = SimpleNamespace(auto_batch_reason=why, spec=SimpleNamespace(training=SimpleNamespace(micro_batch_size=16)))
    fields = ProgressPublisher._auto_batch(trainer)  # type: ignore[arg-type]
    doc = Progress(step=0, total_steps=10, **fields).model_dump(by_alias=True, mode="json", exclude_none=True)
    got = read_progress(doc).progress
    assert (got.micro_batch_size, got.micro_batch_reason) == (16, why)
    fixed = SimpleNamespace(auto_batch_reason=None, spec=SimpleNamespace(training=SimpleNamespace(micro_batch_size=8)))
    assert ProgressPublisher._auto_batch(fixed) == {}  # type: ignore[arg-type]  # a size the spec set: nothing said
