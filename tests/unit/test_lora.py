"""LoRA: only adapters train (frozen weights bit-identical after training), the loss falls, the state dict holds
only adapters, merging gives the adapted model's outputs, and the plan counts trainable parameters."""

from __future__ import annotations

import pytest
import torch

from seqtrain.models import build_model, count_parameters
from seqtrain.models.lora import apply_lora, merge_state
from seqtrain.spec.lora import lora_param_count
from seqtrain.spec.model import LoraSpec, ModelSpec

SPECS = {
    "gpt": ModelSpec(arch="gpt", vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=64, max_seq_len=32),
    "gpt-mlp": ModelSpec(arch="gpt", vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=64, max_seq_len=32,
                         tie_embeddings=False),
    "lstm": ModelSpec(arch="lstm", vocab_size=64, dim=32, layers=2, max_seq_len=32),
    "gru": ModelSpec(arch="gru", vocab_size=64, dim=32, layers=2, max_seq_len=32),
    "qrnn": ModelSpec(arch="qrnn", vocab_size=64, dim=32, layers=2, max_seq_len=32),
}
LORA = {"gpt-mlp": LoraSpec(rank=4, alpha=8, target_modules=["q", "v", "gate", "up", "down"])}


def lora_model(name: str, dropout: float = 0.0) -> tuple[torch.nn.Module, ModelSpec]:
    lora = LORA.get(name, LoraSpec(rank=4, alpha=8)).model_copy(update={"dropout": dropout})
    spec = SPECS[name].model_copy(update={"lora": lora})
    torch.manual_seed(0)
    model = build_model(spec)
    apply_lora(model, lora, spec.arch)
    return model, spec


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]) @ model.output_weight.T
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("name", list(SPECS))
def test_only_adapters_train_and_the_loss_falls(name: str) -> None:
    model, spec = lora_model(name, dropout=0.1 if name.startswith("gpt") else 0.0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert count_parameters(model, trainable_only=True) == lora_param_count(spec)  # what `seqtrain plan` says
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    tokens = torch.randint(0, 64, (8, 24), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    model.train()
    first = None
    for _ in range(30):
        loss = loss_of(model, tokens)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert loss_of(model.eval(), tokens).item() < first - 0.1
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), f"frozen {n} changed"


@pytest.mark.parametrize("name", list(SPECS))
def test_state_dict_holds_only_adapters_and_merging_reproduces_the_model(name: str) -> None:
    model, spec = lora_model(name)
    with torch.no_grad():  # adapters as if trained (B starts at zero)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    sd = model.state_dict()
    assert sd and all("lora_" in k for k in sd)
    fresh, _ = lora_model(name)
    fresh.load_state_dict(sd, strict=True)  # frozen weights count as present
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        want = model.eval()(tokens) @ model.output_weight.T
        assert torch.equal(fresh.eval()(tokens) @ fresh.output_weight.T, want)
        torch.manual_seed(0)
        base = build_model(spec.model_copy(update={"lora": None}))
        merged = build_model(spec.model_copy(update={"lora": None})).eval()
        merged.load_state_dict(merge_state(base.state_dict(), sd, spec.lora), strict=True)
        assert (merged(tokens) @ merged.output_weight.T - want).abs().max().item() < 1e-5


def _job(model: dict, **spec):  # noqa: ANN202
    from seqtrain.spec import parse_job

    return parse_job({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "t"},
                      "spec": {"model": model, "data": {"seqLen": 64}, **spec}})


def test_plan_counts_trainable_parameters_and_their_memory() -> None:
    from seqtrain_operator.planner.memory import estimate

    full = estimate(_job({"arch": "gpt", "preset": "small"}))
    tuned = estimate(_job({"arch": "gpt", "preset": "small", "lora": {"rank": 8}}))
    assert tuned.trainable_params == 6 * 8 * (4 * (384 + 384)) == 147_456
    f, t = full.busiest, tuned.busiest
    assert t.grads == 4 * tuned.trainable_params and t.optimizer == 8 * tuned.trainable_params
    assert t.params == f.params + 4 * tuned.trainable_params
    assert t.params + t.grads + t.optimizer < 0.3 * (f.params + f.grads + f.optimizer)  # 16 -> ~4 bytes/param


def test_plan_command_prints_the_trainable_count(tmp_path, capsys) -> None:
    from seqtrain_operator.cli import main

    job = tmp_path / "j.yaml"
    job.write_text("apiVersion: seqtrain.dev/v1alpha1\nkind: SeqTrainJob\nmetadata: {name: t}\n"
                   "spec:\n  model: {arch: lstm, preset: tiny, lora: {rank: 2}}\n")
    assert main(["plan", str(job)]) == 0
    assert "LoRA: 2,560 trainable (the rest frozen)" in capsys.readouterr().out  # 2 layers x 2 x r 2 x (256 + 64)


def test_lora_settings_are_validated() -> None:
    from seqtrain.spec import SpecError

    with pytest.raises(SpecError, match=r"spec.model.lora.targetModules: proj not in gpt's targets"):
        _job({"arch": "gpt", "lora": {"targetModules": ["q", "proj"]}})
    with pytest.raises(SpecError, match="spec.model.lora: LoRA runs on the native data-parallel engine only"):
        _job({"arch": "gpt", "lora": {"rank": 4}}, optimization={"zero": {"stage": 2}})
    with pytest.raises(SpecError, match="spec.model.lora.rank"):
        _job({"arch": "gpt", "lora": {"rank": 0}})
