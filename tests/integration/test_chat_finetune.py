"""Chat fine-tuning of a Hugging Face folder as a user runs it: a tiny Qwen2.5 made with transformers (no hub) with
its tokenizer and chat template, `seqtrain run` with LoRA on `data.format: chat` (the folder's tokenizer, named
nowhere in the spec), the loss over the assistant tokens falls, and `export --merge-lora` writes a folder that
transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from test_hf_families import WORDS, add_tokenizer, make_folder

from seqtrain_operator.cli import main as cli_main

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


def conversations(n: int) -> list[dict]:
    """Questions of random words answered by a fixed rule (the reversed question): learnable from the user turn."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        q = [WORDS[int(i)] for i in torch.randint(0, 30, (6,), generator=g)]
        out.append({"messages": [{"role": "user", "content": " ".join(q)},
                                 {"role": "assistant", "content": " ".join(reversed(q))}]})
    return out


def test_lora_chat_fine_tune_of_a_qwen_folder(tmp_path: Path) -> None:
    folder = tmp_path / "qwen"
    make_folder("qwen2.5", folder)
    add_tokenizer(folder)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(64)))
    job = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "chat"}, "spec": {
        "model": {"init": str(folder), "lora": {"rank": 8, "alpha": 16, "targetModules": ["q", "v", "up", "down"]}},
        "data": {"source": "jsonl", "format": "chat", "paths": [str(data)], "seqLen": 32, "packing": True,
                 "validationFraction": 0.0},
        "training": {"steps": 30, "globalBatchSize": 8, "microBatchSize": 8, "optimizer": {"lr": 0.02},
                     "eval": {"batches": 0}},
        "checkpoint": {"intervalSteps": 30}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run = tmp_path / "run"
    assert cli_main(["run", str(tmp_path / "job.yaml"), "--workdir", str(run), "-q"]) == 0
    resolved = yaml.safe_load((run / "job.yaml").read_text())["spec"]["data"]
    assert resolved["format"] == "chat" and resolved["tokenizer"]["path"] == str(folder / "tokenizer.json")
    loss = {int(m["step"]): float(m["loss"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in m}
    first, last = sum(loss[s] for s in (1, 2, 3)) / 3, sum(loss[s] for s in range(26, 31)) / 5
    assert last < 0.8 * first, loss
    out = tmp_path / "export"
    assert cli_main(["export", str(run), "--merge-lora", "--out", str(out)]) == 0
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert hf.config.model_type == "qwen2"
