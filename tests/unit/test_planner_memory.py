"""`seqtrain plan` memory figures against numbers computed by hand (ZeRO paper accounting)."""

from __future__ import annotations

import json

import pytest
import yaml

from seqtrain.layout.costs import param_breakdown
from seqtrain.spec import apply_overrides, parse_job
from seqtrain.spec.resolve import resolved_model
from seqtrain_operator.planner.memory import estimate, model_state_bytes, stage_params
from seqtrain_operator.planner.show import plan_command

GB = 1e9


def job(**sets: object):
    base = """
apiVersion: seqtrain.dev/v1alpha1
kind: SeqTrainJob
metadata: {name: mem}
spec:
  model: {arch: gpt, preset: tiny}
  data: {seqLen: 32}
  training: {globalBatchSize: 8, microBatchSize: 8}
"""
    # Feature placeholders (features.py) are not the planner's business: validate the rest only.
    doc = apply_overrides(yaml.safe_load(base), [f"{k}={v}" for k, v in sets.items()])
    return parse_job(doc, check_features=False)


@pytest.mark.parametrize(("stage", "expected_gb"), [(0, 120.0), (1, 31.40625), (2, 16.640625), (3, 1.875)])
def test_zero_paper_figure_1(stage: int, expected_gb: float) -> None:
    # The ZeRO paper's own example: 7.5B parameters, 64-way data parallel, mixed-precision Adam (K = 12).
    ms = model_state_bytes(int(7.5e9), "bf16", stage, 64)
    assert ms.device / GB == pytest.approx(expected_gb)
    assert ms.cpu == 0


def test_fp32_adam_is_4_4_8_bytes_per_parameter() -> None:
    ms = model_state_bytes(1000, "fp32", 0, 8)
    assert (ms.params, ms.grads, ms.optimizer) == (4000, 4000, 8000)
    ms2 = model_state_bytes(1000, "fp32", 2, 8)
    assert (ms2.params, ms2.grads, ms2.optimizer) == (4000, 500, 1000)


def test_offload_moves_optimizer_and_stage3_params_to_host() -> None:
    ms1 = model_state_bytes(1000, "bf16", 1, 4, "cpu")
    assert (ms1.params, ms1.grads, ms1.optimizer, ms1.cpu) == (2000, 2000, 0, 3000)
    ms3 = model_state_bytes(1000, "bf16", 3, 4, "cpu")
    assert (ms3.params, ms3.grads, ms3.optimizer, ms3.cpu) == (0, 500, 0, 3000 + 500)


def test_tiny_gpt_parameter_count_by_hand() -> None:
    p = param_breakdown(resolved_model(job()))
    # embedding 256*64; block: wq+wk+wv+wo 4*64*64, SwiGLU 3*64*176, two RMSNorms 2*64; final norm 64; tied output
    assert p.embedding == 16384
    assert p.block == 16384 + 33792 + 128
    assert p.total == 16384 + 2 * 50304 + 64


def test_tiny_gpt_single_rank_estimate_by_hand() -> None:
    est = estimate(job())
    (r,) = est.stages
    psi = 117056
    assert (r.params_count, r.params, r.grads, r.optimizer) == (psi, 4 * psi, 4 * psi, 8 * psi)
    # activations per token: 2 blocks x (4h norms + h q + 2kv + h attn-out + 4f) + h stage input, fp32,
    # plus fp32 logits and their gradient (no fused loss on CPU); 8 sequences x 32 tokens.
    h, f = 64, 176
    per_tok = 4 * (2 * (4 * h + h + 2 * h + h + 4 * f) + h) + 2 * 4 * 256
    assert r.activations == per_tok * 8 * 32
    assert r.total == 16 * psi + per_tok * 256


def test_sequence_parallel_shards_every_activation_term_by_hand() -> None:
    sets = {"resources.processesPerReplica": 2, "optimization.tensorParallel": 2}
    h, f, v = 64, 176, 256
    tp_only = estimate(job(**sets)).stages[0].activations
    sp = estimate(job(**sets, **{"optimization.sequenceParallel": "true"})).stages[0].activations
    # tp alone: norms (4h) and the stage input (h) replicated; sp: every block term and the input / 2
    assert tp_only == (4 * (2 * (4 * h + (h + 2 * h + h + 4 * f) / 2) + h) + 2 * 4 * v / 2) * 8 * 32
    assert sp == (4 * (2 * (4 * h + h + 2 * h + h + 4 * f) / 2 + h / 2) + 2 * 4 * v / 2) * 8 * 32
    full = {**sets, "optimization.sequenceParallel": "true", "optimization.activationCheckpointing.policy": "full"}
    # full checkpointing: both blocks keep their input (h / 2 each with sp), one is recomputed whole at a time,
    # plus the stage input (h / 2)
    assert estimate(job(**full)).stages[0].activations == (
        (4 * ((4 * h + h + 2 * h + h + 4 * f) / 2 + 2 * h / 2 + h / 2) + 2 * 4 * v / 2) * 8 * 32)


def test_tp2_pp2_mini_split_by_hand() -> None:
    j = job(**{"model.preset": "mini", "data.seqLen": 128, "replicas": 4, "optimization.tensorParallel": 2,
               "optimization.pipelineParallel": 2, "resources.processesPerReplica": 2,
               "training.globalBatchSize": 8, "training.microBatchSize": 4})
    m = resolved_model(j)
    p = param_breakdown(m)
    bounds = [(0, 2), (2, 4)]  # 4 equal blocks; the LM head (2*256*128 flops/token) is lighter than a block
    est = estimate(j)
    assert [s.blocks for s in est.stages] == bounds
    per_block_tp = (4 * 128 * 128 + 3 * 128 * 344) // 2 + 2 * 128
    assert stage_params(p, bounds, 0, 2, True) == 2 * per_block_tp + 256 * 128 // 2
    # the last stage keeps its own copy of the tied embedding shard, plus the final norm
    assert est.stages[1].params_count == 2 * per_block_tp + 128 + 256 * 128 // 2
    # dp = 8 / (2*2) = 2 -> 4 sequences per dp rank split into 4 micro-batches (2 x stages) of 1 sequence
    assert est.pipeline_micro_batches == 4 and est.micro_batch == 1


def test_zero_stage_lowers_busiest_rank_and_fsdp_counts_as_stage3() -> None:
    totals = []
    for stage in (0, 1, 2, 3):
        e = estimate(job(**{"replicas": 4, "optimization.zero.stage": stage, "optimization.precision": "bf16",
                            "training.microBatchSize": 2}))
        totals.append(e.busiest.params + e.busiest.grads + e.busiest.optimizer)
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    fsdp = estimate(job(**{"replicas": 4, "optimization.engine": "native", "optimization.zero.stage": 3,
                           "training.microBatchSize": 2}))
    assert fsdp.engine == "fsdp2" and fsdp.zero_stage == 3


def test_fsdp2_counts_its_shards_plus_the_unsharded_working_set() -> None:
    """Shards 4 + 4 + 8 bytes / dp, plus: root unit and two blocks gathered (bf16 gather: 2 bytes), one block's
    fp32 gradient before its reduce-scatter. No full unsharded gradient (reduce-scatter every micro-batch)."""
    from seqtrain.layout.costs import param_breakdown
    from seqtrain.spec.resolve import resolved_model

    sets = {"replicas": 4, "optimization.engine": "native", "optimization.zero.stage": 3,
            "training.microBatchSize": 1, "training.globalBatchSize": 8}
    for precision, gather in (("bf16", 2), ("fp32", 4)):
        j = job(**sets, **{"optimization.precision": precision})
        r = estimate(j).busiest
        p = param_breakdown(resolved_model(j))
        root = p.embedding + p.final + p.output
        assert r.params == 4 * p.total / 4 + gather * (root + 2 * p.block)
        assert r.grads == 4 * p.total / 4 + 4 * p.block
        assert r.grads < 4 * p.total  # the accumulate-unsharded mode would keep 4 bytes x every parameter


def test_checkpointing_shrinks_activations() -> None:
    full = estimate(job(**{"model.preset": "small", "data.seqLen": 64}))
    ac = job(**{"model.preset": "small", "data.seqLen": 64})
    ac.spec.optimization.activation_checkpointing.policy = "full"
    assert estimate(ac).busiest.activations < full.busiest.activations / 2


def test_plan_command_json_and_exit_codes(tmp_path, capsys) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("apiVersion: seqtrain.dev/v1alpha1\nkind: SeqTrainJob\nmetadata: {name: p}\n"
                 "spec: {replicas: 2, data: {seqLen: 32}, training: {globalBatchSize: 8, microBatchSize: 4}}\n")
    assert plan_command(str(f), None, [], True) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"] == {"dp": 2, "tp": 1, "pp": 1}
    assert d["groups"]["dp"] == [[0, 1]]
    assert d["memoryPerRank"][0]["params_count"] == 117056
    assert plan_command(str(f), None, ["model.heads=3"], False) == 2
    assert "spec.model.heads" in capsys.readouterr().err
    assert plan_command(str(f), None, [], False) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "dp groups: [[0, 1]]" in out


@pytest.mark.parametrize(("arch", "preset", "tied"), [("gpt", "tiny", True), ("gpt", "mini", False),
                                                      ("lstm", "tiny", True), ("gru", "mini", False),
                                                      ("qrnn", "tiny", True)])
def test_analytic_parameter_count_matches_the_built_model(arch: str, preset: str, tied: bool) -> None:
    from seqtrain.models import build_model, count_parameters

    m = resolved_model(job(**{"model.arch": arch, "model.preset": preset, "model.tieEmbeddings": tied}))
    assert param_breakdown(m).total == count_parameters(build_model(m))
