"""data.format chat: jsonl `messages` rendered with the tokenizer folder's chat template, loss only on the assistant
turns. A tiny tokenizer with a ChatML-style template is made here (no hub); transformers, where installed, renders
the same text and (for a `{% generation %}` template) the same assistant mask."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from seqtrain.data.batches import IGNORE_INDEX
from seqtrain.data.chat import ChatDataError
from seqtrain.data.packing import DocumentBatches
from seqtrain.data.sources import load_source
from seqtrain.spec import SpecError, parse_job, resolve
from seqtrain_operator.cli import main as cli_main

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the same turns with transformers' assistant-mask tag around what the assistant writes
TEMPLATE_GEN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}"
                "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["what", "is", "the", "capital", "of", "france", "paris", "two", "plus", "four", "you", "are", "a", "helpful",
         "bot", "thanks", "welcome", "say", "hi", "hello"]
CONVERSATIONS = [
    [{"role": "system", "content": "you are a helpful bot"}, {"role": "user", "content": "what is the capital of france"},
     {"role": "assistant", "content": "paris"}, {"role": "user", "content": "thanks"},
     {"role": "assistant", "content": "you are welcome"}],
    [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}],
    [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hello"}],
]


def tokenizer_folder(folder: Path, template: str | None = TEMPLATE) -> Path:
    """A byte-level BPE tokenizer.json with ChatML's special tokens, and its tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [" ".join(WORDS)] * 10 + ["system user assistant"] * 10
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      special_tokens=["<|endoftext|>"]))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                              "bos_token": None}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def write_chat(path: Path, conversations: list[list[dict[str, Any]]], copies: int = 1) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for _ in range(copies) for c in conversations))
    return path


def chat_job(tok: Path, data: Path, **data_sets: Any) -> Any:
    return resolve(parse_job({"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "c"},
                              "spec": {"model": {"arch": "gpt", "dim": 32, "layers": 1, "heads": 2, "vocabSize": 512},
                                       "data": {"source": "jsonl", "format": "chat", "paths": [str(data)],
                                                "seqLen": 64, "validationFraction": 0.0,
                                                "tokenizer": {"type": "file", "path": str(tok)}, **data_sets}}}))


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def test_the_mask_covers_exactly_the_assistant_turns(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tok_path = tokenizer_folder(tmp_path / "tok")
    data = write_chat(tmp_path / "chat.jsonl", CONVERSATIONS)
    corpus = load_source(chat_job(tok_path, data).spec.data, "train")
    tok = Tokenizer.from_file(str(tok_path))
    assert corpus.loss_mask is not None and len(corpus.loss_mask) == len(corpus.tokens)
    bounds = np.append(corpus.doc_starts, len(corpus))
    assert len(corpus.doc_starts) == len(CONVERSATIONS)
    for conv, a, b in zip(CONVERSATIONS, bounds[:-1], bounds[1:], strict=True):
        ids, mask = np.asarray(corpus.tokens[a:b]), corpus.loss_mask[a:b]
        text = tok.decode(ids.tolist(), skip_special_tokens=False)
        assert text == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv)
        scored = [tok.decode(ids[x:y].tolist(), skip_special_tokens=False) for x, y in runs(mask)]
        assert scored == [f"{m['content']}<|im_end|>\n" for m in conv if m["role"] == "assistant"]


def test_the_mask_reaches_the_batches_as_ignored_targets(tmp_path: Path) -> None:
    tok_path = tokenizer_folder(tmp_path / "tok")
    data = write_chat(tmp_path / "chat.jsonl", CONVERSATIONS)
    corpus = load_source(chat_job(tok_path, data).spec.data, "train")
    for packing in (False, True):
        batches = DocumentBatches(corpus, seq_len=64, micro_batch_size=1, grad_accum=1, shuffle=False, packing=packing)
        seen = 0
        for _ in range(batches.num_sequences):
            (b,) = batches.next_step()
            toks, tgts = b.tokens[0].numpy(), b.targets[0].numpy()
            # a target counts only where the token it predicts is the assistant's; the rest is IGNORE_INDEX
            for col in np.flatnonzero(tgts != IGNORE_INDEX):
                assert tgts[col] == toks[col + 1] if col + 1 < len(toks) else True
            seen += int((tgts != IGNORE_INDEX).sum())
        # every assistant token but none of the rest (no document starts with one: the template opens each)
        assert seen == int(corpus.loss_mask.sum()), packing


def test_transformers_renders_the_same_text_and_assistant_mask(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from seqtrain.data.chat import ChatEncoder
    from seqtrain.data.tokenizer import read_tokenizer_json

    tok_path = tokenizer_folder(tmp_path / "tok", TEMPLATE_GEN)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    ours = ChatEncoder(read_tokenizer_json(str(tok_path))[0], str(tok_path))
    for conv in CONVERSATIONS:
        assert ours.render(conv, False, "x") == hf.apply_chat_template(conv, tokenize=False)
        ids, mask = ours.encode(conv, "x", np.int64)
        out = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(out["input_ids"])
        assert mask.astype(int).tolist() == list(out["assistant_masks"])


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}, r"messages\[0\] has no 'role'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, r"messages\[0\] has role 'robot'"),
    ({"text": "hi"}, "no field 'messages'"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, r"messages\[0\] \(user\) has no 'content'"),
])
def test_bad_records_are_one_line_naming_the_field(tmp_path: Path, record: dict, message: str) -> None:
    tok_path = tokenizer_folder(tmp_path / "tok")
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(record) + "\n")
    with pytest.raises(ChatDataError, match=message) as err:
        load_source(chat_job(tok_path, data).spec.data, "train")
    assert "\n" not in str(err.value) and f"{data}:1" in str(err.value)


def test_a_folder_without_a_chat_template_is_refused_at_validate(tmp_path: Path) -> None:
    tok_path = tokenizer_folder(tmp_path / "tok", template=None)
    data = write_chat(tmp_path / "chat.jsonl", CONVERSATIONS)
    with pytest.raises(SpecError, match=r"spec\.data\.format: chat needs a chat template beside .*tokenizer\.json"):
        chat_job(tok_path, data)
    with pytest.raises(ChatDataError, match="chat needs a chat template"):  # and by the loader, had validate not run
        load_source(chat_job(tok_path, data, format="text").spec.data.model_copy(update={"format": "chat"}), "train")


def test_chat_needs_jsonl_and_a_tokenizer_file(tmp_path: Path) -> None:
    tok_path = tokenizer_folder(tmp_path / "tok")
    data = write_chat(tmp_path / "chat.jsonl", CONVERSATIONS)
    with pytest.raises(SpecError, match=r"spec\.data\.format: chat reads jsonl"):
        chat_job(tok_path, data, source="text")
    with pytest.raises(SpecError, match=r"spec\.data\.format: chat needs a tokenizer"):
        chat_job(tok_path, data, tokenizer={"type": "byte"})


def test_default_format_keeps_plain_jsonl(tmp_path: Path) -> None:
    tok_path = tokenizer_folder(tmp_path / "tok")
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"text": "what is the capital"}) + "\n")
    spec = chat_job(tok_path, data, format="text").spec.data
    assert spec.format == "text" and load_source(spec, "train").loss_mask is None


@pytest.mark.slow
def test_a_tiny_chat_fine_tune_runs_and_learns_the_answers(tmp_path: Path) -> None:
    """`seqtrain run` on chat data: the loss (over assistant tokens only) falls."""
    tok_path = tokenizer_folder(tmp_path / "tok")
    data = write_chat(tmp_path / "chat.jsonl", CONVERSATIONS, copies=16)
    job = {"apiVersion": "seqtrain.dev/v1alpha1", "kind": "SeqTrainJob", "metadata": {"name": "chat"}, "spec": {
        "model": {"arch": "gpt", "dim": 32, "layers": 1, "heads": 2, "ffnDim": 64, "vocabSize": 512},
        "data": {"source": "jsonl", "format": "chat", "paths": [str(data)], "seqLen": 64, "packing": True,
                 "validationFraction": 0.0, "tokenizer": {"type": "file", "path": str(tok_path)}},
        "training": {"steps": 30, "globalBatchSize": 4, "microBatchSize": 4, "optimizer": {"lr": 0.01},
                     "eval": {"batches": 0}},
        "checkpoint": {"intervalSteps": 30}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run = tmp_path / "run"
    assert cli_main(["run", str(tmp_path / "job.yaml"), "--workdir", str(run), "-q"]) == 0
    loss = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "loss" in m:
            loss[int(m["step"])] = float(m["loss"])
    first, last = sum(loss[s] for s in (1, 2, 3)) / 3, sum(loss[s] for s in range(26, 31)) / 5
    assert last < 0.5 * first, loss


def test_prepare_data_chat_writes_the_mask_the_tokens_source_reads(tmp_path: Path, capsys) -> None:
    """`prepare-data --format chat --tokenizer FOLDER`: the same tokens and assistant mask as the jsonl loader,
    memory-mapped through source tokens (packing and validation split alike)."""
    tok_path = tokenizer_folder(tmp_path / "tok")
    data = write_chat(tmp_path / "chat.jsonl", CONVERSATIONS)
    out = tmp_path / "prepared"
    assert cli_main(["prepare-data", str(data), "--format", "chat", "--tokenizer", str(tmp_path / "tok"),
                     "--out", str(out), "-q"]) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["loss_mask"] is True and index["documents"] == len(CONVERSATIONS)
    prepared = load_source(chat_job(tok_path, out, source="tokens", format="text").spec.data, "train")
    direct = load_source(chat_job(tok_path, data).spec.data, "train")
    bounds = np.append(prepared.doc_starts, len(prepared))
    eod = index["eod"]
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        ids, mask = np.asarray(prepared.tokens[np.arange(a, b)]), np.asarray(prepared.loss_mask[np.arange(a, b)])
        da, db = direct.doc_starts[k], (np.append(direct.doc_starts, len(direct)))[k + 1]
        assert ids[:-1].tolist() == np.asarray(direct.tokens[da:db]).tolist() and ids[-1] == eod
        assert mask[:-1].tolist() == direct.loss_mask[da:db].tolist() and mask[-1] == 0  # the EOD is not scored
    batches = DocumentBatches(prepared, seq_len=64, micro_batch_size=1, grad_accum=1, shuffle=False, packing=True)
    seen = sum(int((b.targets != IGNORE_INDEX).sum()) for _ in range(batches.num_sequences) for b in batches.next_step())
    assert seen == int(direct.loss_mask.sum())
    with pytest.raises(SpecError, match=r"spec\.data\.format: a prepared folder carries its own format"):
        chat_job(tok_path, out, source="tokens")
    capsys.readouterr()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "tokenizer.json").write_bytes(tok_path.read_bytes())
    assert cli_main(["prepare-data", str(data), "--format", "chat", "--tokenizer", str(tmp_path / "plain"),
                     "--out", str(tmp_path / "o2"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--format chat needs a chat template" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert cli_main(["prepare-data", str(bad), "--format", "chat", "--tokenizer", str(tmp_path / "tok"),
                     "--out", str(tmp_path / "o3"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no assistant turn" in err and "bad.jsonl" in err


# Qwen3's shape: the last assistant turn gets an empty think block that earlier turns do not have
TEMPLATE_THINK = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
                  "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_the_last_turn_apart_still_masks_each_reply(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tok_path = tokenizer_folder(tmp_path / "tok", TEMPLATE_THINK)
    data = write_chat(tmp_path / "chat.jsonl", CONVERSATIONS[:1])  # two assistant turns
    corpus = load_source(chat_job(tok_path, data).spec.data, "train")
    tok = Tokenizer.from_file(str(tok_path))
    ids = np.asarray(corpus.tokens)
    scored = [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in runs(corpus.loss_mask)]
    # the first reply as written, the last with the think block its own rendering has
    assert scored == ["paris<|im_end|>\n", "<think>\n\n</think>\n\nyou are welcome<|im_end|>\n"]
