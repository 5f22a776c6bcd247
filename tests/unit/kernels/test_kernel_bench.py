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
