"""`seqtrain generate`: sample from a trained model, streaming tokens to the terminal.

GPT decodes with a key/value cache (the prompt is one forward pass, then one position per new token); LSTM, GRU
and QRNN carry their recurrent state. `use_cache=False` recomputes the whole sequence for every token: slower,
and the reference the cached paths are tested against (greedy decoding must give the same tokens).

A GPT writes as long as asked: once prompt and sample fill the model's context (model.maxSeqLen), it sees the last
`maxSeqLen` tokens, as nanoGPT's sampler crops its input. Positions are absolute, so when the window slides every
cached key is stale: the cache is rebuilt from the window (one forward pass of the window per token from then on,
the cost of decoding without a cache).

Sampling: `temperature 0` is greedy (argmax); otherwise logits / temperature, then top-k, then top-p (nucleus:
the smallest set of tokens whose probability reaches p), drawn from a generator seeded by `seed`.
"""

from __future__ import annotations

import codecs
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from seqtrain.models.gpt import GPT
from seqtrain.models.layers import rope
from seqtrain.models.recurrent import RecurrentLM


@dataclass
class Sampling:
    max_new_tokens: int = 200
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


def sample_next(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B]."""
    if s.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / s.temperature
    if s.top_k is not None and 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach p (the most likely one always stays)
        drop = probs.cumsum(dim=-1) - probs >= s.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


# ---- GPT with a key/value cache ---------------------------------------------------------------------------
class KVCache:
    """Per block: keys and values [B, kv_heads, max_len, Dh], filled up to `length`."""

    def __init__(self, model: GPT, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        a = model.blocks[0].attn
        shape = (batch, a.kv_heads, max_len, a.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.blocks]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.blocks]
        self.length = 0


def _cached_attention(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                      layer: int) -> torch.Tensor:
    """`CausalSelfAttention` on new positions x [B, t, D] that follow `cache.length` cached ones."""
    b, t, _ = x.shape
    q, k, v = attn.split_heads(*attn.project(x))  # per head, q/k normalised (qkNorm); fused as in training
    if attn.rope:
        q, k = rope(q, cos, sin), rope(k, cos, sin)
    start, end = cache.length, cache.length + t
    cache.k[layer][:, :, start:end] = k
    cache.v[layer][:, :, start:end] = v
    keys, values = cache.k[layer][:, :, :end], cache.v[layer][:, :, :end]
    if attn.kv_heads != attn.heads:  # grouped-query attention, grouped as in training (repeat_interleave)
        rep = attn.heads // attn.kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    # new position i (absolute start + i) sees every cached position and the new ones up to itself
    mask = torch.ones(t, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
    if attn.window is not None:  # and, with a sliding window, only the last `window` positions
        mask = mask.triu(diagonal=start - attn.window + 1)
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return attn.out(y.transpose(1, 2).reshape(b, t, attn.heads * attn.head_dim))


def gpt_forward_cached(model: GPT, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Hidden states [B, t, D] of `tokens` [B, t] placed after the cached positions; extends the cache."""
    t = tokens.shape[1]
    start = cache.length
    cos, sin = model.rope_cos[start:start + t], model.rope_sin[start:start + t]
    x = model.embed(tokens)
    if model.pos_embed is not None:  # learned positions (GPT-2)
        x = x + model.pos_embed(torch.arange(start, start + t, device=tokens.device))
    for i, block in enumerate(model.blocks):
        x = x + _cached_attention(block.attn, block.attn_norm(x), cos, sin, cache, i)
        x = x + block.mlp(block.mlp_norm(x))
    cache.length += t
    return model.norm(x)


# ---- the decoding loop ------------------------------------------------------------------------------------
def _logits(model: nn.Module, hidden_last: torch.Tensor) -> torch.Tensor:
    return hidden_last @ model.output_weight.T


def max_context(model: nn.Module) -> int | None:
    return model.rope_cos.shape[0] if isinstance(model, GPT) else None


@torch.no_grad()
def generate_ids(model: nn.Module, prompt: list[int], s: Sampling, use_cache: bool = True) -> Iterator[int]:
    """Yield new token ids one at a time (batch of one)."""
    if not prompt:
        raise ValueError("--prompt: the prompt must have at least one token")
    model.eval()
    device = model.output_weight.device
    gen = None
    if s.temperature > 0:
        gen = torch.Generator(device=device)
        gen.manual_seed(s.seed if s.seed is not None else torch.seed())
    limit = max_context(model)
    # the context the model sees: the last `limit` tokens of prompt + sample (a longer prompt is cropped the same way)
    ids = torch.tensor([prompt if limit is None else prompt[-limit:]], dtype=torch.long, device=device)
    steps = s.max_new_tokens
    step: Callable[[torch.Tensor], torch.Tensor]
    if not use_cache:
        def step(new: torch.Tensor) -> torch.Tensor:
            nonlocal ids
            if new is not ids:
                ids = torch.cat((ids, new), dim=1)
                if limit is not None:
                    ids = ids[:, -limit:]
            return model(ids)[:, -1]
    elif isinstance(model, GPT):
        assert limit is not None
        cache = KVCache(model, 1, limit, model.output_weight.dtype, device)

        def step(new: torch.Tensor) -> torch.Tensor:
            nonlocal ids
            if new is ids:  # the prompt: one forward pass
                return gpt_forward_cached(model, ids, cache)[:, -1]
            ids = torch.cat((ids, new), dim=1)[:, -limit:]
            if cache.length + new.shape[1] > limit:  # the window slid: rebuild the cache at the new positions
                cache.length = 0
                return gpt_forward_cached(model, ids, cache)[:, -1]
            return gpt_forward_cached(model, new, cache)[:, -1]
    elif isinstance(model, RecurrentLM):
        state = model.init_state(1, model.embed.weight)

        def step(new: torch.Tensor) -> torch.Tensor:
            nonlocal state
            out, state = model._chunk(new, None, *state)
            return model.norm(out)[:, -1]
    else:
        raise TypeError(f"no generation path for {type(model).__name__}")
    new = ids
    for _ in range(max(0, steps)):
        hidden = step(new)
        nxt = sample_next(_logits(model, hidden), s, gen)
        yield int(nxt.item())
        new = nxt.view(1, 1)


class StreamDecoder:
    """Turns token ids into text pieces as they arrive (byte-level: UTF-8 sequences split over tokens are held
    back until complete; tokenizer.json: the growing decode's new suffix)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.byte_level = getattr(tokenizer, "vocab_size", None) == 256 and not hasattr(tokenizer, "_tok")
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        if self.byte_level:
            return self.utf8.decode(bytes([token & 0xFF]))
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        piece, self.text = text[len(self.text):], text
        return piece

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True) if self.byte_level else ""


def pick_device(device: str | None) -> torch.device:
    """--device as a torch device this machine has; ValueError naming the flag and the fix otherwise."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r}: not a device name (cpu, cuda, cuda:1 ...)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device}: this machine has no CUDA device; use --device cpu")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s) (cuda:0 to "
                             f"cuda:{count - 1}); pick one of them or cpu")
    elif dev.type != "cpu":
        raise ValueError(f"--device {device}: only cpu and cuda devices are supported")
    return dev


def load_generator(path: str, device: str | None = None) -> tuple[nn.Module, Any]:
    """(model in eval mode on `device`, tokenizer) from any source `seqtrain export` accepts. The tokenizer
    carries `eod` (prepare-data's end-of-document id, or None) and `ids_only` (why the model's ids are not
    text this tokenizer encodes, or None)."""
    from seqtrain.data.sources import FileTokenizer
    from seqtrain.data.tokenizer import ByteTokenizer
    from seqtrain.export.weights import WeightsError, check_shapes, load_source
    from seqtrain.models import build_model

    dev = pick_device(device)  # before any loading: a wrong flag fails at once
    w = load_source(path)
    if w.lora is not None:
        from seqtrain.export.merge import merge_weights

        w = merge_weights(w)
    if w.tokenizer.get("type") == "synthetic":
        raise WeightsError(f"{path}: trained on a synthetic task, which has no text tokenizer to generate with")
    if w.tokenizer.get("refused"):
        raise WeightsError(w.tokenizer["refused"])
    with torch.device(dev):
        model = build_model(w.spec)
    check_shapes(w.state, model, w.origin)
    model.load_state_dict(w.state, strict=True)
    tok = FileTokenizer(w.tokenizer["path"]) if w.tokenizer.get("type") == "file" else ByteTokenizer()
    tok.eod = w.tokenizer.get("eod")  # prepare-data's end-of-document id: the sample ends there
    tok.ids_only = _ids_not_text(w, vocab_of(model))
    return model.eval(), tok


def vocab_of(model: nn.Module) -> int:
    """The model's vocabulary: the rows of its output projection (generation builds it without padding)."""
    return int(model.output_weight.shape[0])


def _ids_not_text(w: Any, vocab: int) -> str | None:
    """Why the byte tokenizer's ids are not this model's (None: they are, or a tokenizer file encodes its text).
    nanoGPT's char-level recipe trains on ids from `data.source: tokens` with no tokenizer: its ids 0..64 are
    characters only its own prepare script knows, not the bytes 0..64."""
    if w.tokenizer.get("type") != "byte" or "eod" in w.tokenizer:  # prepare-data's byte folders record an eod
        return None
    data = w.job.spec.data if w.job is not None else None
    if data is not None and data.source == "tokens":
        import os

        # raw token files (not prepare-data folders, whose index.json names the tokenizer), found from here
        found = [p for p in data.paths if os.path.exists(os.path.expanduser(p))]
        if found and all(os.path.isfile(os.path.expanduser(p)) for p in found):
            return "the run trained on ids from data.source: tokens without a tokenizer"
    if vocab < 256:
        return "the model has no tokenizer and fewer ids than the byte tokenizer's 256: its ids are not bytes"
    return None


def check_prompt(tok: Any, prompt: str | None, prompt_ids: list[int] | None, vocab: int) -> list[int]:
    """The prompt as model ids: --prompt-ids as given, --prompt through the tokenizer; ValueError (one line,
    naming the problem and the flag that works) for an id outside the vocabulary or text for a model whose ids
    are not text."""
    fix = "give the prompt as ids with --prompt-ids 1,2,3 or train with a tokenizer"
    if prompt_ids is not None:
        bad = [i for i in prompt_ids if i >= vocab]
        if bad:
            raise ValueError(f"--prompt-ids: id {bad[0]} is outside this model's vocabulary of {vocab} ids "
                             f"(0 to {vocab - 1})")
        return prompt_ids
    ids = [int(i) for i in tok.encode(prompt or "")]
    if not ids:
        raise ValueError("--prompt: the prompt must have at least one token")
    reason = getattr(tok, "ids_only", None)
    bad = next((i for i in ids if i >= vocab), None)
    if bad is not None:
        if hasattr(tok, "id_to_token"):  # a tokenizer.json larger than the model's vocabulary
            what, why = f"token {tok.id_to_token(bad)!r}", "the tokenizer has more ids than the model"
            fix = "give the prompt as ids with --prompt-ids 1,2,3 or generate with the tokenizer the model trained with"
        else:
            what = f"byte {chr(bad)!r}" if bad < 128 else f"byte 0x{bad:02x}"
            why = reason or "the model has fewer ids than the byte tokenizer's 256"
        raise ValueError(f"--prompt: the prompt's {what} is id {bad}, outside this model's vocabulary of {vocab} "
                         f"ids: {why}; {fix}")
    if reason:
        raise ValueError(f"--prompt: {reason}, so text has no ids for it (the byte tokenizer would read {prompt!r} "
                         f"as ids that mean something else to this model); {fix}")
    return ids


def generate_command(path: str, prompt: str | None, s: Sampling, use_cache: bool = True, device: str | None = None,
                     out: Any = None, prompt_ids: list[int] | None = None) -> int:
    """Stream a sample to `out`: text, or ids (comma-separated, as --prompt-ids takes them) when the prompt was
    given as ids or the model's ids are not text (a run on token ids without a tokenizer: decoding them as bytes
    would print control characters)."""
    from seqtrain.checkpoint.safe_load import CheckpointUnavailable
    from seqtrain.export.weights import WeightsError

    out = out or sys.stdout
    try:
        model, tok = load_generator(path, device)
        as_ids = prompt_ids is not None
        prompt_ids = check_prompt(tok, prompt, prompt_ids, vocab_of(model))
        stream = StreamDecoder(tok)
        out.write(",".join(map(str, prompt_ids)) if as_ids else str(prompt))
        out.flush()
        t0, n = time.perf_counter(), 0
        eod, ended = getattr(tok, "eod", None), False
        for token in generate_ids(model, prompt_ids, s, use_cache):
            if token == eod:
                ended = True
                break
            out.write(f",{token}" if as_ids else stream.push(token))
            out.flush()
            n += 1
        out.write(("" if as_ids else stream.flush()) + "\n")
        out.flush()
        seconds = time.perf_counter() - t0
    except (WeightsError, ValueError, FileNotFoundError) as exc:
        print(f"seqtrain generate: {exc}", file=sys.stderr)
        return 2
    except CheckpointUnavailable as exc:  # out of memory, storage I/O: try again later
        print(f"seqtrain generate: {exc}", file=sys.stderr)
        return 1
    dev = model.output_weight.device.type
    limit = max_context(model)
    full = ", stopped at the end-of-document token" if ended else ""
    if limit is not None and len(prompt_ids) + n > limit:
        full += f", the model saw the last {limit} tokens (its context) at each step"
    print(f"[{n} tokens in {seconds:.2f}s, {n / seconds if seconds else 0:.1f} tokens/s on {dev}, "
          f"{'kv cache' if use_cache else 'no cache'}{full}]", file=sys.stderr)
    return 0
