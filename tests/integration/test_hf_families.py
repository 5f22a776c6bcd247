"""Hugging Face models as users have them: a tiny random model of each family made with transformers (no hub),
`model.init` from its folder gives transformers' logits, and `seqtrain export --format hf` writes a folder that
transformers loads as the same family with the same logits.

Families and what each exercises: Llama 3.x (rope_type llama3), Llama with linear and yarn RoPE scaling, Qwen2.5
(q/k/v biases, tied output), Qwen3 (q/k RMSNorm, head_dim 32 with hidden 64 / 4 heads), Mistral (sliding window 5
< 16 tokens) and GPT-2 (LayerNorm, gelu_new, learned positions, biases, Conv1D weights, fused qkv). Biases and
norm scales are drawn away from 0/1 so a lost or swapped one shows. Tolerance 1e-5 on logits up to about 4
(fp32): measured at most 2e-6, import and export alike; each test's control (the same weights with the family's switch turned off) moves
the logits by more than 1e-3, so the switch is really exercised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from seqtrain.export.init import load_initial_weights
from seqtrain.export.weights import load_source
from seqtrain.export.writer import export
from seqtrain.models import build_model
from seqtrain.spec import SpecError, parse_job, resolve

os.environ["HF_HUB_OFFLINE"] = "1"  # transformers reads local folders only
transformers = pytest.importorskip("transformers")

TOL = 1e-5
VOCAB, SEQ = 256, 16
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 64, "initializer_range": 0.1}

# family id -> (transformers config class, kwargs, model_type it must export as, the switch whose absence the control shows)
FAMILIES: dict[str, tuple[str, dict[str, Any], str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8}},
               "llama", {"rope_scaling": None}),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
                     "llama", {"rope_scaling": None}),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 16}},
                   "llama", {"rope_scaling": None}),
    "qwen2.5": ("Qwen2Config", {"tie_word_embeddings": True}, "qwen2", {"qkv_bias": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}, "qwen3", {"qk_norm": False}),
    "mistral": ("MistralConfig", {"sliding_window": 5}, "mistral", {"sliding_window": None}),
    "gpt2": ("GPT2Config", {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                            "initializer_range": 0.1}, "gpt2", {"mlp": "swiglu"}),
}


def make_folder(family: str, folder: Path) -> Any:
    """A random transformers model of `family` saved to `folder`; returns the model (eval, fp32)."""
    cls, kw, _, _ = FAMILIES[family]
    cfg = getattr(transformers, cls)(**kw) if cls == "GPT2Config" else getattr(transformers, cls)(**COMMON, **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm scales around 1, biases around 0
                p.copy_((torch.rand(p.shape, generator=g) + 0.5) if "norm" in name or ".ln_" in name
                        else torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(str(folder))
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))


def hf_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens()).logits


def seqtrain_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens()) @ model.output_weight.T


def init_job(folder: Path | str, **sets: Any) -> Any:
    """A job that starts from `folder` and names nothing else about the model: all of it comes from the folder."""
    model = {"init": str(folder), **sets}
    return resolve(parse_job({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob",
                              "metadata": {"name": "hf"}, "spec": {"model": model, "data": {"seqLen": SEQ}}}))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_init_from_the_folder_gives_transformers_logits(tmp_path: Path, family: str) -> None:
    folder = tmp_path / family
    want = hf_logits(make_folder(family, folder))
    spec = init_job(folder).spec.model  # everything resolved from config.json alone
    model = build_model(spec).eval()
    assert "model.init:" in load_initial_weights(model, str(folder))
    diff = (seqtrain_logits(model) - want).abs().max().item()
    assert diff < TOL, f"{family}: max |logit diff| {diff:.2e}"
    # the control: the same weights without the family's switch are far off, so the switch is what matched
    off = build_model(spec.model_copy(update=FAMILIES[family][3])).eval()
    off.load_state_dict(load_source(str(folder)).state, strict=False)
    assert (seqtrain_logits(off) - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_as_the_same_family(tmp_path: Path, family: str) -> None:
    folder = tmp_path / family
    make_folder(family, folder)
    w = load_source(str(folder))
    model = build_model(w.spec).eval()
    model.load_state_dict(w.state, strict=True)
    out = tmp_path / "export"
    assert export(str(folder), str(out))["format"] == "hf"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == FAMILIES[family][2]
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert again.config.model_type == FAMILIES[family][2]
    diff = (hf_logits(again) - seqtrain_logits(model)).abs().max().item()
    assert diff < TOL, f"{family}: export max |logit diff| {diff:.2e}"
    (out / "seqtrain.json").unlink()  # a folder as transformers writes it reads back to the same spec
    assert load_source(str(out)).spec.model_dump() == w.spec.model_dump()


@pytest.mark.parametrize("key,value,message", [
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
     "config.json: rope_parameters.rope_type 'dynamic' is not supported; supported: llama3, linear, yarn"),
    ("hidden_act", "gelu", "config.json: hidden_act 'gelu' is not supported; supported: 'silu'"),
    ("model_type", "falcon", "config.json: model_type 'falcon' is not supported; supported: llama, mistral, qwen2, "
                             "qwen3, gpt2"),
    ("layer_types", ["full_attention", "sliding_attention"],
     "config.json: layer_types mixes full and sliding attention, which is not supported"),
])
def test_a_config_seqtrain_cannot_represent_is_refused_naming_the_key(tmp_path: Path, key: str, value: Any,
                                                                     message: str) -> None:
    folder = tmp_path / "m"
    make_folder("mistral", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError) as err:
        init_job(folder)
    assert message in str(err.value)
    assert "holds no model description" not in str(err.value)


def test_an_explicit_field_that_contradicts_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    make_folder("gpt2", folder)
    with pytest.raises(SpecError, match=r"spec\.model\.norm: rmsnorm does not fit the weights in model.init"):
        init_job(folder, norm="rmsnorm")


WORDS = [f"w{i}" for i in range(200)]
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"


def add_tokenizer(folder: Path, words: list[str] = WORDS) -> None:
    """A word-level tokenizer.json (special tokens first) and the tokenizer_config.json transformers writes beside
    it, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE}))


def test_the_folders_tokenizer_is_the_jobs_unless_the_spec_names_another(tmp_path: Path) -> None:
    folder = tmp_path / "qwen"
    make_folder("qwen2.5", folder)
    assert init_job(folder).spec.data.tokenizer.type == "byte"  # no tokenizer.json: bytes (vocabulary 256 fits)
    add_tokenizer(folder)
    tok = init_job(folder).spec.data.tokenizer
    assert (tok.type, tok.path) == ("file", str(folder / "tokenizer.json"))
    other = tmp_path / "other.json"
    (other).write_bytes((folder / "tokenizer.json").read_bytes())
    job = resolve(parse_job({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "x"},
                             "spec": {"model": {"init": str(folder)}, "data": {
                                 "seqLen": SEQ, "tokenizer": {"type": "file", "path": str(other)}}}}))
    assert job.spec.data.tokenizer.path == str(other)  # named by the spec: kept


def test_a_tokenizer_with_more_ids_than_the_model_is_refused_at_validate(tmp_path: Path) -> None:
    folder = tmp_path / "qwen"
    make_folder("qwen2.5", folder)
    add_tokenizer(folder, [f"w{i}" for i in range(300)])  # 302 ids for a 256-row embedding
    with pytest.raises(SpecError, match=r"spec\.data\.tokenizer: .* has 302 token ids but the weights in model.init"):
        init_job(folder)


@pytest.mark.slow
def test_lora_fine_tune_of_a_qwen_folder_trains_and_exports_with_its_tokenizer(tmp_path: Path) -> None:
    """`seqtrain run` from a Qwen2.5 folder with its tokenizer: the run keeps the tokenizer (and its chat template),
    LoRA trains, `export --merge-lora` writes a qwen2 folder with the tokenizer that transformers loads with the
    logits of seqtrain's merged model."""
    import yaml

    from seqtrain_operator.cli import main as cli_main

    folder = tmp_path / "qwen"
    make_folder("qwen2.5", folder)
    add_tokenizer(folder)
    text = tmp_path / "corpus.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text("\n".join(" ".join(WORDS[int(i)] for i in torch.randint(0, 40, (30,), generator=g))
                              for _ in range(60)))
    job = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "ft"}, "spec": {
        "model": {"init": str(folder), "lora": {"rank": 4, "alpha": 8, "targetModules": ["q", "v", "up"]}},
        "data": {"source": "text", "paths": [str(text)], "seqLen": SEQ},
        "training": {"steps": 6, "globalBatchSize": 4, "microBatchSize": 4, "optimizer": {"lr": 0.05}},
        "checkpoint": {"intervalSteps": 6}}}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    assert cli_main(["run", str(job_file), "--workdir", str(run_dir), "-q"]) == 0
    assert (run_dir / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert "chat_template" in json.loads((run_dir / "tokenizer_config.json").read_text())
    out = tmp_path / "export"
    assert cli_main(["export", str(run_dir), "--merge-lora", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    w = load_source(str(out))
    base = load_source(str(folder))
    assert not torch.equal(w.state["blocks.0.attn.q.weight"], base.state["blocks.0.attn.q.weight"])  # LoRA moved it
    assert torch.equal(w.state["blocks.0.attn.k.weight"], base.state["blocks.0.attn.k.weight"])  # not a target
    model = build_model(w.spec).eval()
    model.load_state_dict(w.state, strict=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    diff = (hf_logits(hf) - seqtrain_logits(model)).abs().max().item()
    assert diff < TOL, f"merged export max |logit diff| {diff:.2e}"
    # the tokenizer class by name: AutoTokenizer would rebuild a Qwen2Tokenizer around this toy vocabulary
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    assert tok.apply_chat_template([{"role": "user", "content": "w1 w2"}], tokenize=False) == "<|user|> w1 w2 "
    assert tok("w1 w2")["input_ids"] == [3, 4] and tok.eos_token == "<|endoftext|>"
    assert yaml.safe_load((run_dir / "job.yaml").read_text())["spec"]["data"]["tokenizer"]["type"] == "file"


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "qwen3", "mistral", "gpt2"])
def test_greedy_generation_equals_transformers_token_for_token(tmp_path: Path, family: str) -> None:
    """The KV-cache decoder honours the switches too (q/k norm, learned positions, the sliding window over cached
    positions: 6 + 14 tokens through a window of 5)."""
    from seqtrain.generate import Sampling, generate_ids

    folder = tmp_path / family
    hf = make_folder(family, folder)
    w = load_source(str(folder))
    model = build_model(w.spec).eval()
    model.load_state_dict(w.state, strict=True)
    prompt = tokens()[0, :6].tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, min_new_tokens=14,
                           pad_token_id=0)[0, 6:].tolist()
    for cache in (True, False):
        got = list(generate_ids(model, prompt, Sampling(max_new_tokens=14, temperature=0.0), use_cache=cache))
        assert got == want, (family, cache)


def hub_cache(home: Path, folder: Path, repo: str, commit: str = "0123abcd" * 5, ref: str = "main") -> Path:
    """`folder` put into a Hugging Face cache under `home` as huggingface_hub lays it out: blobs named by content,
    snapshots/<commit>/<file> linking to ../../blobs/<blob>, refs/<ref> holding the commit."""
    import hashlib

    org, name = repo.split("/")
    root = home / "hub" / f"models--{org}--{name}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        (root / "blobs" / blob).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/{blob}")
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snap


def test_hf_uri_resolves_from_the_local_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "qwen3"
    want = hf_logits(make_folder("qwen3", folder))
    add_tokenizer(folder)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snap = hub_cache(tmp_path / "home", folder, "acme/tiny-qwen3")
    for uri in ("hf://acme/tiny-qwen3", "hf://acme/tiny-qwen3@main", f"hf://acme/tiny-qwen3@{snap.name}"):
        job = init_job(uri)
        assert job.spec.model.qk_norm and job.spec.model.head_dim == 32
        assert job.spec.data.tokenizer.path == str(snap / "tokenizer.json")  # the cache's link, followed
        model = build_model(job.spec.model).eval()
        load_initial_weights(model, uri)
        assert (seqtrain_logits(model) - want).abs().max().item() < TOL
    with pytest.raises(SpecError, match=r"hf://acme/other: not in the local Hugging Face cache .*huggingface-cli "
                                        r"download acme/other"):
        init_job("hf://acme/other")
    with pytest.raises(SpecError, match=r"revision 'v2' is not in the local Hugging Face cache"):
        init_job("hf://acme/tiny-qwen3@v2")
    # a link out of the repository's own folder is not the cache's layout: refused like any other link
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(Exception, match="a symbolic link"):
        load_source("hf://acme/tiny-qwen3")


def test_byte_ids_for_a_model_with_its_own_vocabulary_are_refused_at_validate(tmp_path: Path) -> None:
    """A Llama folder without its tokenizer.json: training it on byte ids would run and report success on the
    wrong tokens. Validation says so once, with what to do."""
    folder = tmp_path / "llama"
    cfg = transformers.LlamaConfig(**{**COMMON, "vocab_size": 160})
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder))
    with pytest.raises(SpecError) as err:
        init_job(folder)
    assert [p.path for p in err.value.problems] == ["spec.data.tokenizer"]
    assert "byte-level ids (0-255) do not fit the 160-token vocabulary" in str(err.value)
    add_tokenizer(folder, WORDS[:150])  # 152 ids: its own tokenizer fits
    assert init_job(folder).spec.data.tokenizer.path == str(folder / "tokenizer.json")
