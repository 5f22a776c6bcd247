"""`seqtrain bench gpu` on a machine without CUDA: every part runs as far as it can on tiny shapes and the
GPU-only figures say "skipped: no CUDA" (on a GPU machine this runs the real, minutes-long benchmark: skip)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from seqtrain.benchmarks import gpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; on a GPU run the real bench")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dry run of every part, as a fresh GPU machine would run it: torch, triton and pytest but no kopf,
    kubernetes or deepspeed (sitecustomize makes them unimportable in the bench, its parts and pytest). The two
    tests below read it (one run, not two: each part imports torch in a process of its own)."""
    tmp = tmp_path_factory.mktemp("bench-gpu")
    root = Path(__file__).resolve().parents[2]
    site = tmp / "site"
    site.mkdir()
    # sitecustomize runs in every Python process that has `site` on its path: the bench, its parts, pytest
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "for name in ('deepspeed', 'tensorboard', 'prometheus_client', 'tokenizers', 'matplotlib', 'psutil', "
        "'rich', 'kopf', 'kubernetes'):\n"
        "    sys.modules[name] = None  # as if not installed: import raises ImportError\n")
    out = tmp / "out"
    env = {"PYTHONPATH": f"{site}:{root / 'trainer'}:{root / 'operator'}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "seqtrain.benchmarks.gpu", "--out", str(out), "--parts",
                           "mfu,training,tests"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    log = out / "bench.log"
    assert proc.returncode == 0, proc.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    return out


@pytest.mark.slow
def test_dry_run_writes_every_part(dry_run: Path) -> None:
    summary = json.loads((dry_run / "summary.json").read_text())
    assert summary["dry_run"] is True and list(summary["parts"]) == ["mfu", "training", "tests"]
    tests = json.loads((dry_run / "tests.json").read_text())
    # the GPU tests are collected (not run) from exactly the GPU test files
    assert tests["status"].startswith("ok: collected") and tests["files"] == gpu.GPU_TEST_FILES
    assert tests["collected"] == len(tests["tests"]) >= 10
    assert {t.split("::")[0] for t in tests["tests"]} == set(gpu.GPU_TEST_FILES)
    training = json.loads((dry_run / "training.json").read_text())
    assert training["status"] == "ok"
    for precision in ("bf16", "fp16"):
        run = training[precision]
        assert run["finite"] and len(run["losses"]) == run["steps"] and run["tokens_per_s"] > 0
        assert run["attention_kernels"], "the profiler names the attention kernel that ran"
    assert training["fp16"]["loss_scale"] > 0 and training["bf16"]["loss_scale"] is None
    mfu = json.loads((dry_run / "mfu.json").read_text())
    assert mfu["status"] == "ok" and mfu["measured_matmul_peak"] == {"status": gpu.NO_CUDA}
    assert mfu["peak"]["tflops"] is None and "slots" in mfu["formula"]
    for ac in ("none", "full"):
        run = mfu[f"activation_checkpointing_{ac}"]
        assert run["mfu"] is None and run["model_tflops_per_s"] > 0 and all(math.isfinite(x) for x in run["losses"])
        # the copy task: every position is computed, about half are targets; MFU counts the computed ones
        assert run["slots_per_step"] > run["tokens_per_step"] > 0
    # the same initial weights and data: checkpointing changes memory, not the losses
    assert mfu["activation_checkpointing_none"]["losses"][0] == mfu["activation_checkpointing_full"]["losses"][0]
    assert summary["headline"]["peak"] == mfu["peak"]
    # the batch people train with: micro-batches accumulated into one optimizer step, beside one micro-batch a step
    assert mfu["runs"][0] == "accumulated_micro4" and mfu["status"] == "ok"
    one = mfu["activation_checkpointing_none"]
    for m in (4, 8):
        run = mfu[f"accumulated_micro{m}"]
        assert run["micro_batch"] == m and run["micro_batches_per_step"] == 2 and run["model_tflops_per_s"] > 0
        assert run["slots_per_step"] == 2 * m * one["slots_per_step"] // one["micro_batch"]
        assert f"mfu_accumulated_micro{m}" in summary["headline"]
    # the headline's twin with q/k/v and gate/up split: what optimization.fusedProjections gains, measured
    fused, split = mfu["accumulated_micro4"], mfu["accumulated_micro4_unfused"]
    assert fused["fused_projections"] is True and split["fused_projections"] is False
    assert split["slots_per_step"] == fused["slots_per_step"] and split["model_tflops_per_s"] > 0
    assert fused["losses"][0] == pytest.approx(split["losses"][0], rel=1e-2)  # same weights and data, bf16
    assert "mfu_accumulated_micro4_unfused" in summary["headline"]
    assert one["micro_batches_per_step"] == 1


def test_mfu_divides_model_flops_of_every_computed_position_by_the_datasheet_peak() -> None:
    run = {"slots_per_s": 1000.0, "tokens_per_s": 500.0}
    got = gpu.mfu_of(run, flops_per_slot=6e9, datasheet_tflops=989.5, measured_tflops=790.0)
    assert got["model_tflops_per_s"] == 6.0
    assert got["mfu"] == round(6e12 / 989.5e12, 4) and got["mfu_vs_measured_matmul_peak"] == round(6 / 790, 4)


@pytest.mark.slow
def test_a_part_past_its_deadline_is_killed_and_the_next_still_runs(tmp_path: Path) -> None:
    code = gpu.main(["--out", str(tmp_path), "--parts", "training,tests", "--deadline", "training=0.1"])
    assert code == 1
    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert parts["training"]["status"] == "error: killed at its deadline of 0.1s"
    assert parts["tests"]["status"].startswith("ok: collected")


def test_gpu_test_files_are_exactly_the_files_with_gpu_tests() -> None:
    root = Path(__file__).resolve().parents[2]
    gpu_mark = re.compile(r"^(@pytest\.mark\.gpu\b|pytestmark = .*pytest\.mark\.gpu\b)", re.M)
    marked = {str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py") if gpu_mark.search(p.read_text())}
    assert marked == set(gpu.GPU_TEST_FILES)


@pytest.mark.slow
def test_kernels_part_runs_the_kernel_bench_on_the_interpreter(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    assert gpu.main(["--out", str(tmp_path), "--parts", "kernels"]) == 0
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert kernels["status"] == "ok" and {r["op"] for r in kernels["summary"]} == {"rms_norm", "attention"}
    assert all(r["kernel_ms"] and r["reference_ms"] and r["baseline_ms"] for r in kernels["summary"])
    # attention is compared with what the trainer runs (its own SDPA call), not only the masked reference
    assert {r["baseline"] for r in kernels["summary"] if r["op"] == "attention"} >= {"SDPA is_causal (trainer)"}


@pytest.mark.slow
def test_parts_past_the_budget_are_recorded_as_skipped(tmp_path: Path) -> None:
    assert gpu.main(["--out", str(tmp_path), "--parts", "tests,training", "--budget-s", "-1"]) == 0
    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert all(p["status"].startswith("skipped: over the") for p in parts.values())
    assert not (tmp_path / "training.json").exists()


def test_unknown_part_is_named() -> None:
    with pytest.raises(SystemExit):
        gpu.main(["--out", "/tmp/x", "--parts", "tests,gpu"])


def test_mfu_model_is_about_1_3b_parameters() -> None:
    from seqtrain.layout.costs import param_breakdown
    from seqtrain.obs.flops import token_flops

    job = gpu._job(gpu.MFU_MODEL, gpu.MFU_SEQ, 4, 1, "bf16", "none", True)
    params = param_breakdown(job.spec.model).total
    assert 1.2e9 < params < 1.45e9
    assert token_flops(job.spec.model, gpu.MFU_SEQ).training > 6 * params  # 6N plus attention


@pytest.mark.slow
def test_runs_with_only_torch_numpy_pydantic_and_yaml(dry_run: Path) -> None:
    """A fresh GPU machine has torch, triton and pytest but no kopf, kubernetes or deepspeed: neither the bench
    (each part a process of its own) nor the collection of the GPU tests may need them (`dry_run` hides them)."""
    assert json.loads((dry_run / "training.json").read_text())["status"] == "ok"
    assert json.loads((dry_run / "mfu.json").read_text())["status"] == "ok"
    assert json.loads((dry_run / "tests.json").read_text())["collected"] >= 10


def test_missing_packages_are_named_with_the_fix(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(gpu.REQUIRED, "no_such_module_xyz", "no-such-wheel")
    assert gpu.main(["--out", "/tmp/unused", "--parts", "tests"]) == 2
    err = capsys.readouterr().err
    assert "no-such-wheel" in err and "pip install" in err and "--no-index" in err


@pytest.mark.slow
def test_the_gpu_tests_progress_names_the_test_that_was_running_when_the_part_was_killed(tmp_path: Path) -> None:
    """The tests part is killed at its deadline; its JSON must still say which test ran and what had passed
    (the first H100 lease's tests part was killed and told nothing)."""
    (tmp_path / "test_sample.py").write_text(
        "import time\n\ndef test_fast():\n    pass\n\ndef test_hangs():\n    time.sleep(600)\n")
    progress = tmp_path / "tests.json"
    env = {**os.environ, "SEQTRAIN_PYTEST_PROGRESS": str(progress),
           "PYTHONPATH": os.pathsep.join([str(gpu.REPO / "trainer"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                             "seqtrain.benchmarks.pytest_progress", "test_sample.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(1200):  # until the progress file shows the hanging test running (not a speed check)
            if progress.exists() and json.loads(progress.read_text())["running"] == "test_sample.py::test_hangs":
                break
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    state = json.loads(progress.read_text())
    assert state["status"] == "running: test_sample.py::test_hangs"
    assert state["passed"] == ["test_sample.py::test_fast"] and state["failed"] == []
    assert "test_sample.py::test_fast" in state["seconds"]


def test_mfu_accumulates_to_half_a_million_tokens_per_step_on_a_gpu() -> None:
    runs = {r["key"]: r for r in gpu.mfu_runs(True, 4)}
    assert list(runs)[0] == "accumulated_micro4"  # the headline first: a deadline cuts from the end
    assert list(runs)[-1] == "accumulated_micro4_unfused" and runs["accumulated_micro4_unfused"]["fused"] is False
    for m in (4, 8):
        r = runs[f"accumulated_micro{m}"]
        assert r["micro"] == m and r["global"] * gpu.MFU_SEQ == gpu.ACCUM_TOKENS == 524_288
    assert runs["accumulated_micro8"]["may_not_fit"] and not runs["accumulated_micro4"].get("may_not_fit")
    assert runs["activation_checkpointing_none"]["global"] == runs["activation_checkpointing_none"]["micro"] == 4


def test_profile_flag_runs_the_profile_right_after_mfu() -> None:
    assert gpu._parse(["--out", "x", "--profile"]).parts.split(",") == ["mfu", "profile", "kernels", "training",
                                                                        "tests"]
    assert gpu._parse(["--out", "x", "--parts", "tests", "--profile"]).parts == "profile,tests"
    assert gpu._parse(["--out", "x"]).parts.split(",") == gpu.DEFAULT_PARTS


@pytest.mark.parametrize(("name", "cls"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "matmul"), ("aten::mm", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("void at::native::(anonymous namespace)::fused_adamw_kernel", "optimizer_and_clip"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor<float, 2>>",
     "optimizer_and_clip"), ("optimizer.step/aten::sqrt", "optimizer_and_clip"),
    ("void at::native::cunn_SoftMaxForward<4, float, float, float, at::native::LogSoftMaxForwardEpilogue>",
     "pointwise"), ("aten::_log_softmax", "loss"), ("aten::nll_loss_backward", "loss"),
    ("triton_poi_fused_add_mul_rsqrt_0", "pointwise"), ("Memcpy HtoD (Pinned -> Device)", "memory_copies"),
])
def test_kernels_are_classed_by_name(name: str, cls: str) -> None:
    assert gpu.kernel_class(name) == cls


def test_breakdown_counts_overlaps_once_and_reports_the_gpu_idle_time() -> None:
    kernels = [("nvjet_gemm", 0.0, 400.0), ("triton_poi_fused_0", 300.0, 200.0), ("fused_adamw_kernel", 1000.0, 500.0)]
    got = gpu.breakdown(kernels, wall_ms=2.0, device=True)
    assert got["ms_by_class"]["matmul"] == 0.4 and got["ms_by_class"]["optimizer_and_clip"] == 0.5
    assert got["ms_by_class"]["pointwise"] == 0.2 and set(got["ms_by_class"]) == set(gpu.KERNEL_CLASS_NAMES)
    # busy: [0, 500] and [1000, 1500] = 1.0 ms of a 1.5 ms span; idle 0.5 ms
    assert (got["gpu_span_ms"], got["gpu_busy_ms"], got["gpu_idle_ms"]) == (1.5, 1.0, 0.5)
    assert gpu.breakdown(kernels, wall_ms=2.0, device=False)["gpu_idle_ms"] is None  # the CPU has no idle figure


def test_the_trace_is_kept_only_under_its_cap(tmp_path: Path) -> None:
    import gzip

    class Prof:
        def export_chrome_trace(self, path: str) -> None:
            Path(path).write_text(json.dumps({"traceEvents": [{"name": f"k{i}", "ts": i} for i in range(2000)]}))

    kept = gpu.write_trace(Prof(), tmp_path)
    assert kept["trace"] == gpu.PROFILE_TRACE and kept["trace_bytes"] < kept["trace_raw_bytes"]
    assert len(json.loads(gzip.decompress((tmp_path / gpu.PROFILE_TRACE).read_bytes()))["traceEvents"]) == 2000
    dropped = gpu.write_trace(Prof(), tmp_path, cap=100)
    assert dropped["trace"] is None and "over the cap" in dropped["trace_note"]
    assert not (tmp_path / gpu.PROFILE_TRACE).exists()


@pytest.mark.slow
def test_dry_run_profiles_one_step_by_kernel_class(tmp_path: Path) -> None:
    assert gpu.main(["--out", str(tmp_path), "--parts", "profile"]) == 0
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof["status"] == "ok" and prof["activities"] == ["CPU"] and prof["micro_batches_per_step"] == 2
    assert set(prof["ms_by_class"]) == set(gpu.KERNEL_CLASS_NAMES)
    for cls in ("matmul", "attention", "loss", "optimizer_and_clip"):
        assert prof["ms_by_class"][cls] > 0, cls
    assert prof["gpu_idle_ms"] is None and (tmp_path / prof["trace"]).stat().st_size <= gpu.TRACE_CAP_BYTES


def test_gpu_tests_run_in_parallel_with_a_thread_timeout_where_the_plugins_are() -> None:
    both = gpu.gpu_test_options(has_timeout=True, has_xdist=True)
    assert "--timeout-method=thread" in both and f"--timeout={gpu.GPU_TEST_TIMEOUT_S}" in both
    assert both[both.index("-n") + 1] == str(gpu.GPU_TEST_WORKERS)
    assert gpu.gpu_test_options(has_timeout=False, has_xdist=False) == []
