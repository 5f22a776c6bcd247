"""`seqtrain bench kernels` runs on the CPU (Triton interpreter) and writes the JSON it promises."""

from __future__ import annotations

import json

import pytest
import torch

from seqtrain.benchmarks import kernels as bench


def test_bench_writes_time_memory_and_accuracy(tmp_path, device):
    out = tmp_path / "kernels.json"
    argv = ["--device", device, "--ops", "swiglu,rope", "--shapes", "small", "--repeat", "1", "--warmup", "0",
            "--compile", "off", "--out", str(out)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "kernels" and data["command"].startswith("seqtrain bench kernels --device")
    assert [r["op"] for r in data["results"]] == ["swiglu", "rope"]
    for row in data["results"]:
        for impl in ("kernel", "reference"):
            assert row[impl]["ms"] > 0 and row[impl]["peak_mb"] > 0
        assert row["memory_ratio"] > 0
    for op in ("swiglu", "rope"):
        assert [a["dtype"] for a in data["accuracy"][op]] == ["float32", "bfloat16"]
        assert all(a["passes"] for a in data["accuracy"][op])
    assert data["dtype"] == ("bfloat16" if torch.cuda.is_available() else "float32")


def test_bench_rejects_unknown_op(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--ops", "softmax"])
    assert exc.value.code == 2
    assert "--ops: unknown op(s) softmax" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's conversion; a GPU compiles the kernels")
def test_interpreter_runs_program_id_loops_under_numpy_2_5(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lent GPU machine's pair, triton 3.6 and numpy 2.5.2, as the mirror's dry run meets it: Triton 3.6's
    interpreter converts a scalar with `int(array)` and numpy 2.5 refuses that for a 1-element array. Here it is
    reproduced with 3.6's conversion and numpy's deprecation of it turned into the error 2.5 raises: the probe
    kernel (a loop over program-id bounds) fails, and runs right once `patch_interpreter_for_numpy` is applied."""
    import warnings

    import numpy as np

    interpreter = pytest.importorskip("triton.runtime.interpreter")
    from seqtrain.benchmarks.gpu import interpreter_problem

    def triton_3_6(tensor, scope):  # noqa: ANN001, ANN202 - Triton 3.6's own, with its `int(self.handle.data)`
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    original = interpreter._patch_lang_tensor
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", triton_3_6)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Conversion of an array with ndim > 0", category=DeprecationWarning)
        monkeypatch.setattr(np, "__version__", "2.4.6")  # below 2.5: nothing is patched, the probe fails
        assert "fails with numpy" in (interpreter_problem() or "")
        monkeypatch.setattr(np, "__version__", "2.5.2")
        assert bench.patch_interpreter_for_numpy() is not None
        assert interpreter_problem() is None  # the probe ran and wrote [0, 1, 2, 3]
    import triton.language as tl

    assert tl.tensor.__dict__.get("__index__") is None, "the interpreter's patch outlived the launch"
