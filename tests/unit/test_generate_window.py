"""`generate` writes as long as asked: past a GPT's context the model sees the last `maxSeqLen` tokens, as
nanoGPT's sampler crops its input; the KV cache is rebuilt when the window slides and gives the same greedy tokens
as that crop recomputed from scratch."""

from __future__ import annotations

import pytest
import torch

from seqtrain.export.weights import Weights
from seqtrain.export.writer import export
from seqtrain.generate import Sampling, generate_ids
from seqtrain.models import build_model
from seqtrain.spec.model import ModelSpec
from seqtrain_operator.cli import main as cli_main

CONTEXT = 16
SPEC = ModelSpec(arch="gpt", vocab_size=256, dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=64,
                 max_seq_len=CONTEXT, init_std=0.5)  # a wide init: sharp, position-dependent greedy streams


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(SPEC).eval()


@torch.no_grad()
def nanogpt_greedy(m: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """nanoGPT's sampling loop: crop to the last block_size tokens, one full forward per token."""
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        logits = m(ids[:, -CONTEXT:])[:, -1] @ m.output_weight.T
        nxt = logits.argmax(-1, keepdim=True)
        out.append(int(nxt))
        ids = torch.cat((ids, nxt), dim=1)
    return out


@pytest.mark.parametrize("prompt_len", [5, CONTEXT, CONTEXT + 7], ids=["short", "full", "longer-than-context"])
@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "no-cache"])
def test_greedy_past_the_context_is_nanogpts_crop(prompt_len: int, use_cache: bool) -> None:
    m = model()
    prompt = [(7 * i + 3) % 256 for i in range(prompt_len)]
    want = nanogpt_greedy(m, prompt, 3 * CONTEXT)
    got = list(generate_ids(m, prompt, Sampling(max_new_tokens=3 * CONTEXT, temperature=0), use_cache=use_cache))
    assert got == want
    assert len(set(got[CONTEXT:])) > 1  # past the window the stream still depends on its context


def test_the_cli_writes_as_many_tokens_as_asked(tmp_path, capsys) -> None:
    m = model()
    export(Weights(spec=SPEC, state=m.state_dict()), str(tmp_path / "m"))
    assert cli_main(["generate", str(tmp_path / "m"), "--prompt", "hello", "--max-new-tokens", "40",
                     "--temperature", "0", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "[40 tokens in " in err, err
    assert f"the model saw the last {CONTEXT} tokens (its context) at each step" in err, err
    assert "context" not in err.replace(f"the last {CONTEXT} tokens (its context)", ""), err
    assert out.startswith("hello")
