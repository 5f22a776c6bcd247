"""nanoGPT's model written in a SeqTrainJob (issue 37): `mlp: gelu-exact` and `normBias: false` make seqtrain's GPT
compute nanoGPT's (karpathy/nanoGPT model.py) logits, with its train.py default `bias = False` and with `bias = True`;
`mlp: gelu` stays GPT-2's tanh GELU and every existing spec keeps its parameter names.

The reference below is written from nanoGPT's description (fused c_attn, LayerNorm(ndim, bias), c_fc + nn.GELU() +
c_proj, pre-norm blocks, wte + wpe, ln_f, lm_head tied to wte), with the attention spelled out (masked softmax, as
nanoGPT's non-flash path) so it shares no code with seqtrain's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seqtrain.layout.costs import param_breakdown
from seqtrain.models import build_model, count_parameters
from seqtrain.models.layers import GeluMLP, LayerNorm, make_norm
from seqtrain.spec import SpecError, parse_job, resolved_model
from seqtrain.spec.hf import HFConfigError, hf_config, spec_from_hf_config
from seqtrain.spec.model import ModelSpec

VOCAB, DIM, LAYERS, HEADS, CTX = 256, 48, 2, 4, 32  # byte-level: the builtin data's vocabulary


# ---- nanoGPT's model, the reference ---------------------------------------------------------------------------


class RefLayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class RefAttention(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM, bias=bias)
        self.c_proj = nn.Linear(DIM, DIM, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.c_attn(x).split(DIM, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, c))


class RefBlock(nn.Module):
    def __init__(self, bias: bool, gelu: nn.Module) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = RefLayerNorm(DIM, bias), RefAttention(bias), RefLayerNorm(DIM, bias)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM, bias=bias), gelu, nn.Linear(4 * DIM, DIM, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    def __init__(self, bias: bool, gelu: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(CTX, DIM)
        self.h = nn.ModuleList(RefBlock(bias, gelu) for _ in range(LAYERS))
        self.ln_f = RefLayerNorm(DIM, bias)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def reference(bias: bool, gelu: nn.Module, seed: int = 0) -> RefGPT:
    """Random weights large enough that GELU's curve, the norms' weights and biases all move the logits."""
    torch.manual_seed(seed)
    ref = RefGPT(bias, gelu).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("weight") and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3 if p.dim() == 1 else 0.15)
    return ref


def seqtrain_state(ref: RefGPT) -> dict[str, torch.Tensor]:
    """nanoGPT's tensors under seqtrain's names: c_attn's rows split into q, k and v."""
    out = {"embed.weight": ref.wte.weight, "pos_embed.weight": ref.wpe.weight}
    norms = {"attn_norm": "ln_1", "mlp_norm": "ln_2"}
    for i, blk in enumerate(ref.h):
        p = f"blocks.{i}."
        for ours, theirs in norms.items():
            out[p + ours + ".weight"] = getattr(blk, theirs).weight
            if getattr(blk, theirs).bias is not None:
                out[p + ours + ".bias"] = getattr(blk, theirs).bias
        for kind in ("weight", "bias"):
            fused = getattr(blk.attn.c_attn, kind)
            if fused is None:
                continue
            for name, part in zip("qkv", fused.split(DIM, dim=0), strict=True):
                out[f"{p}attn.{name}.{kind}"] = part
            out[f"{p}attn.out.{kind}"] = getattr(blk.attn.c_proj, kind)
            out[f"{p}mlp.up.{kind}"] = getattr(blk.mlp[0], kind)
            out[f"{p}mlp.down.{kind}"] = getattr(blk.mlp[2], kind)
    out["norm.weight"] = ref.ln_f.weight
    if ref.ln_f.bias is not None:
        out["norm.bias"] = ref.ln_f.bias
    return out


def job(model: dict, **spec: object) -> dict:
    return {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "nanogpt"},
            "spec": {"model": model, "data": {"source": "builtin", "seqLen": CTX}, **spec}}


def nanogpt_model(bias: bool, mlp: str = "gelu-exact") -> dict:
    """nanoGPT's GPTConfig as a SeqTrainJob's model section (train.py's default is bias False)."""
    return {"arch": "gpt", "vocabSize": VOCAB, "dim": DIM, "layers": LAYERS, "heads": HEADS, "maxSeqLen": CTX,
            "norm": "layernorm", "mlp": mlp, "positions": "learned", "normBias": bias, "qkvBias": bias,
            "outBias": bias, "mlpBias": bias, "tieEmbeddings": True, "dropout": 0.0}


def seqtrain_from(ref: RefGPT, model: dict) -> tuple[ModelSpec, nn.Module]:
    spec = resolved_model(parse_job(job(model)))
    ours = build_model(spec).eval()
    ours.load_state_dict(seqtrain_state(ref), strict=True)  # same tensors, no name left over on either side
    return spec, ours


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens) @ model.output_weight.T


TOKENS = torch.randint(0, VOCAB, (3, CTX), generator=torch.Generator().manual_seed(1))


# ---- the same logits ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["bias-false", "bias-true"])
def test_seqtrain_computes_nanogpts_logits(bias: bool) -> None:
    ref = reference(bias, nn.GELU())
    spec, ours = seqtrain_from(ref, nanogpt_model(bias))
    assert spec.ffn_dim == 4 * DIM  # nanoGPT's 4 x n_embd, derived for gelu-exact as for gelu
    with torch.no_grad():
        want = ref(TOKENS)
    got = logits(ours, TOKENS)
    diff = (got - want).abs().max().item()
    print(f"nanoGPT bias={bias}: max |logit diff| {diff:.2e} on logits up to {want.abs().max().item():.2f}")
    assert diff < 1e-5, diff
    # the tanh GELU is measurably another model here: the test would see a wrong activation
    _, tanh = seqtrain_from(ref, nanogpt_model(bias, mlp="gelu"))
    assert (logits(tanh, TOKENS) - want).abs().max().item() > 1e-4


def test_mlp_gelu_is_still_gpt2s_tanh_gelu_with_every_bias() -> None:
    """`mlp: gelu` unchanged: nanoGPT's model with GELU's tanh form and biases everywhere is GPT-2's."""
    ref = reference(True, nn.GELU(approximate="tanh"), seed=2)
    _, ours = seqtrain_from(ref, nanogpt_model(True, mlp="gelu") | {"normBias": None})
    with torch.no_grad():
        want = ref(TOKENS)
    assert (logits(ours, TOKENS) - want).abs().max().item() < 1e-5


def test_gelu_mlp_formulas() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16) * 3
    mlp = GeluMLP(16, 32, bias=True)
    h = mlp.up(x)
    tanh = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    with torch.no_grad():
        assert torch.equal(mlp(x), mlp.down(F.gelu(h, approximate="tanh")))  # the default: bit for bit as before
        assert (mlp(x) - mlp.down(tanh)).abs().max().item() < 1e-5
        mlp.approximate = "none"
        assert torch.equal(mlp(x), mlp.down(nn.GELU()(h)))  # nanoGPT's module
        assert (mlp(x) - mlp.down(0.5 * h * (1 + torch.erf(h / math.sqrt(2))))).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="approximate"):
        GeluMLP(16, 32, approximate="sigmoid")


# ---- names and counts of existing specs are unchanged ----------------------------------------------------------


def test_existing_specs_keep_their_parameter_names() -> None:
    """The names (and order) a GPT-2-shaped and the default block had before normBias and gelu-exact existed."""
    gpt2 = ModelSpec(arch="gpt", vocab_size=VOCAB, dim=DIM, layers=1, heads=HEADS, kv_heads=HEADS, ffn_dim=4 * DIM,
                     max_seq_len=CTX, norm="layernorm", mlp="gelu", positions="learned", qkv_bias=True,
                     out_bias=True, mlp_bias=True)
    assert list(build_model(gpt2).state_dict()) == [
        "embed.weight", "pos_embed.weight", "blocks.0.attn_norm.weight", "blocks.0.attn_norm.bias",
        "blocks.0.attn.q.weight", "blocks.0.attn.q.bias", "blocks.0.attn.k.weight", "blocks.0.attn.k.bias",
        "blocks.0.attn.v.weight", "blocks.0.attn.v.bias", "blocks.0.attn.out.weight", "blocks.0.attn.out.bias",
        "blocks.0.mlp_norm.weight", "blocks.0.mlp_norm.bias", "blocks.0.mlp.up.weight", "blocks.0.mlp.up.bias",
        "blocks.0.mlp.down.weight", "blocks.0.mlp.down.bias", "norm.weight", "norm.bias"]
    default = ModelSpec(arch="gpt", vocab_size=VOCAB, dim=DIM, layers=1, heads=HEADS, kv_heads=HEADS, ffn_dim=64,
                        max_seq_len=CTX)
    assert list(build_model(default).state_dict()) == [
        "embed.weight", "blocks.0.attn_norm.weight", "blocks.0.attn.q.weight", "blocks.0.attn.k.weight",
        "blocks.0.attn.v.weight", "blocks.0.attn.out.weight", "blocks.0.mlp_norm.weight", "blocks.0.mlp.gate.weight",
        "blocks.0.mlp.up.weight", "blocks.0.mlp.down.weight", "norm.weight"]
    # normBias true is layernorm's own default: the same names
    same = gpt2.model_copy(update={"norm_bias": True})
    assert list(build_model(same).state_dict()) == list(build_model(gpt2).state_dict())


@pytest.mark.parametrize("bias", [False, True, None])
def test_the_planners_parameter_count_is_the_models(bias: bool | None) -> None:
    spec = resolved_model(parse_job(job(nanogpt_model(bool(bias)) | {"normBias": bias})))
    assert param_breakdown(spec).total == count_parameters(build_model(spec))


def test_norm_modules() -> None:
    x = torch.randn(2, 5, 8)
    plain = LayerNorm(8, bias=False)
    assert plain.bias is None and [n for n, _ in plain.named_parameters()] == ["weight"]
    assert torch.equal(plain(x), F.layer_norm(x, (8,), None, None, 1e-5))
    assert make_norm("layernorm", 8, 1e-5).bias is not None
    assert make_norm("layernorm", 8, 1e-5, False).bias is None
    assert not hasattr(make_norm("rmsnorm", 8, 1e-5, False), "bias")
    with pytest.raises(ValueError, match="normBias true needs norm layernorm"):
        make_norm("rmsnorm", 8, 1e-5, True)


def test_the_kernel_dispatch_takes_a_layernorm_without_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    from seqtrain.models.dispatch import apply_kernels

    monkeypatch.setenv("SEQTRAIN_KERNELS", "torch")
    ref = reference(False, nn.GELU())
    _, ours = seqtrain_from(ref, nanogpt_model(False))
    want = logits(ours, TOKENS)
    apply_kernels(ours, True)
    assert ours.blocks[0].attn_norm.use_kernels
    assert (logits(ours, TOKENS) - want).abs().max().item() < 1e-5


# ---- validation ------------------------------------------------------------------------------------------------


def test_norm_bias_with_rmsnorm_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError) as err:
        parse_job(job({"arch": "gpt", "dim": DIM, "layers": 1, "norm": "rmsnorm", "normBias": True}))
    problems = [p for p in err.value.problems if p.path == "spec.model.normBias"]
    assert len(problems) == 1 and "\n" not in problems[0].message, err.value.problems
    assert "layernorm" in problems[0].message and "remove normBias" in problems[0].message
    parse_job(job({"arch": "gpt", "dim": DIM, "layers": 1, "norm": "rmsnorm", "normBias": False}))  # no bias: fine
    with pytest.raises(SpecError, match="spec.model.normBias: only applies to arch gpt"):
        parse_job(job({"arch": "lstm", "normBias": False}))


# ---- Hugging Face GPT-2 --------------------------------------------------------------------------------------


GPT2_CFG = {"model_type": "gpt2", "vocab_size": VOCAB, "n_embd": DIM, "n_layer": LAYERS, "n_head": HEADS,
            "n_positions": CTX}


@pytest.mark.parametrize("act,mlp", [("gelu", "gelu-exact"), ("gelu_new", "gelu"), ("gelu_pytorch_tanh", "gelu"),
                                     (None, "gelu")])
def test_gpt2_import_reads_the_activation(act: str | None, mlp: str) -> None:
    cfg = GPT2_CFG | ({"activation_function": act} if act else {})
    spec = spec_from_hf_config(cfg, "config.json")
    assert spec.mlp == mlp and spec.has_norm_bias


def test_gpt2_import_refuses_other_activations() -> None:
    with pytest.raises(HFConfigError, match="activation_function 'relu' is not supported"):
        spec_from_hf_config(GPT2_CFG | {"activation_function": "relu"}, "config.json")


def test_gpt2_export_writes_the_activation_and_refuses_norms_without_bias() -> None:
    spec = resolved_model(parse_job(job(nanogpt_model(True))))
    assert hf_config(spec)["activation_function"] == "gelu"
    assert hf_config(spec.model_copy(update={"mlp": "gelu"}))["activation_function"] == "gelu_new"
    back = spec_from_hf_config(hf_config(spec), "config.json")
    assert back.mlp == "gelu-exact"
    with pytest.raises(HFConfigError, match=r"norm_bias False \(GPT-2 has True\).*--format seqtrain"):
        hf_config(spec.model_copy(update={"norm_bias": False}))


def test_transformers_gpt2_with_exact_gelu_gives_the_same_logits(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from seqtrain.export.weights import Weights
    from seqtrain.export.writer import export

    ref = reference(True, nn.GELU(), seed=3)
    spec, ours = seqtrain_from(ref, nanogpt_model(True))
    export(Weights(spec=spec, state=ours.state_dict(), origin="test"), str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["activation_function"] == "gelu"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf_model(TOKENS).logits
    assert (got - logits(ours, TOKENS)).abs().max().item() < 1e-4


# ---- model.init from a seqtrain export without norm biases ---------------------------------------------------


def test_an_export_without_norm_biases_is_a_model_init_source(tmp_path) -> None:
    from seqtrain.export.weights import Weights, WeightsError, load_source
    from seqtrain.export.writer import export
    from seqtrain.spec.init_source import describe_init

    ref = reference(False, nn.GELU(), seed=4)
    spec, ours = seqtrain_from(ref, nanogpt_model(False))
    weights = Weights(spec=spec, state=ours.state_dict(), origin="test")
    with pytest.raises(Exception, match="norm_bias False") as err:  # no transformers family: refused, one reason
        export(weights, str(tmp_path / "hf"))
    assert isinstance(err.value, HFConfigError | WeightsError)
    out = tmp_path / "st"
    export(weights, str(out), fmt="seqtrain")
    desc = describe_init(str(out))
    assert desc is not None and desc["norm_bias"] is False and desc["mlp"] == "gelu-exact"
    init = {"init": str(out)}
    resolved = resolved_model(parse_job(job(init)))
    assert resolved.norm_bias is False and resolved.mlp == "gelu-exact"
    back = load_source(str(out))
    again = build_model(back.spec).eval()
    again.load_state_dict(back.state, strict=True)
    assert torch.equal(logits(again, TOKENS), logits(ours, TOKENS))
    with pytest.raises(SpecError) as refused:
        parse_job(job(init | {"normBias": True}))
    assert [p.path for p in refused.value.problems] == ["spec.model.normBias"], refused.value.problems
    assert "blocks.0.attn_norm.bias is absent" in refused.value.problems[0].message


def test_a_gpt2_folder_says_its_norms_have_a_bias(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CFG | {"activation_function": "gelu"}))
    with pytest.raises(SpecError) as refused:
        parse_job(job({"init": str(tmp_path), "normBias": False}))
    assert [p.path for p in refused.value.problems] == ["spec.model.normBias"], refused.value.problems
    resolved = resolved_model(parse_job(job({"init": str(tmp_path)})))
    assert resolved.norm_bias is True and resolved.mlp == "gelu-exact"
