"""Chat-formatted data (`data.format: chat`): jsonl lines `{"messages": [{"role": ..., "content": ...}, ...]}`
tokenised with the tokenizer folder's chat template, scored only on the assistant turns.

The template is the one transformers' `apply_chat_template` renders (tokenizer_config.json's `chat_template`, or
chat_template.jinja beside tokenizer.json), rendered the way transformers renders it: a sandboxed jinja2
environment with trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now` and the `{% generation %}` tag. The
text is then encoded without added special tokens (the template writes them), as transformers does.

Which tokens are the assistant's: for assistant message i the template renders messages[:i] with the generation
prompt, then messages[:i+1]; what the second adds to the first is the turn's text (its content and end-of-turn
marker: the model learns to stop). That text is found in the whole conversation's rendering (in order), and every
token whose characters overlap it is scored. A template that renders the last turn apart (Qwen3's empty <think>
block) falls back to the reply's own text and the end-of-turn marker after it. Templates that mark turns with `{% generation %}` need nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from seqtrain.runtime.exitcodes import InvalidConfig
from seqtrain.spec.chat_template import FIELD, template_of, token_text

ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatDataError(InvalidConfig, ValueError):
    """Bad chat data or a tokenizer folder without a usable chat template: one line naming the field and fix."""


def find_template(tokenizer_json: str) -> tuple[str, dict[str, Any]]:
    try:
        return template_of(tokenizer_json)
    except ValueError as exc:
        raise ChatDataError(str(exc)) from None


def _compile(source: str) -> Any:  # noqa: ANN401 - a jinja2 Template
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatDataError(f"{FIELD}: chat templates need the jinja2 package (pip install jinja2)") from None

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:  # noqa: ANN401
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,  # noqa: ANN401
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatDataError(f"{FIELD}: the chat template does not compile ({str(exc).splitlines()[0][:160]})") \
            from None


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:  # noqa: ANN401 - a parsed JSON value
    """The `messages` of one record, checked: a list of {role, content} with at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f"{where}: no 'messages' list (data.format chat reads lines like "
                            '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]})')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatDataError(f"{where}: messages[{i}] has no 'role' (one of {', '.join(ROLES)})")
        if m["role"] not in ROLES:
            raise ChatDataError(f"{where}: messages[{i}] has role {m['role']!r}, not one of {', '.join(ROLES)}")
        content = m.get("content")
        if not (isinstance(content, str) or (isinstance(content, list) and content)) and not m.get("tool_calls"):
            raise ChatDataError(f"{where}: messages[{i}] ({m['role']}) has no 'content' string")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError(f"{where}: no assistant turn, so nothing to learn (data.format chat scores only "
                            "assistant turns); add one or drop the line")
    return messages


class ChatEncoder:
    """Conversations -> (token ids, per-token "scored" mask) with one tokenizer folder's chat template."""

    def __init__(self, tok: Any, tokenizer_json: str) -> None:  # noqa: ANN401 - tokenizers.Tokenizer
        self.tok = tok
        source, config = find_template(tokenizer_json)
        self.template = _compile(source)
        self.specials = {k: token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                                   "pad_token")}

    def render(self, messages: Sequence[dict[str, Any]], generation_prompt: bool, where: str) -> str:
        import jinja2

        try:
            return self.template.render(messages=list(messages), add_generation_prompt=generation_prompt,
                                        **self.specials)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as exc:
            raise ChatDataError(f"{where}: the chat template refuses this conversation "
                                f"({str(exc).splitlines()[0][:160]})") from None

    def spans(self, messages: Sequence[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the character spans of its assistant turns)."""
        text = self.render(messages, False, where)
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], True, where) if i else ""
            upto = self.render(messages[:i + 1], False, where)
            if not upto.startswith(before):
                raise ChatDataError(f"{where}: the chat template renders messages[{i}] so that the text before it "
                                    "changes, so its tokens cannot be told apart; data.format chat needs a template "
                                    "that appends each turn")
            turn = upto[len(before):]
            at = text.find(turn, cursor) if turn else -1
            if at >= 0:
                end = at + len(turn)
            else:
                # Templates that render the last assistant turn apart (Qwen3 adds an empty <think> block to it
                # only): the reply itself and what follows it in the turn (the end-of-turn marker) are the span.
                content = m.get("content") if isinstance(m.get("content"), str) else ""
                k = turn.rfind(content) if content else -1
                at = text.find(content, cursor) if k >= 0 else -1
                if at < 0:
                    raise ChatDataError(f"{where}: the chat template renders messages[{i}] differently inside the "
                                        "whole conversation, so its tokens cannot be found; data.format chat needs a "
                                        "template that renders each reply as written")
                end = at + len(content)
                suffix = turn[k + len(content):]
                end += len(suffix) if suffix and text.startswith(suffix, end) else 0
            spans.append((at, end))
            cursor = end
        return text, spans

    def encode(self, messages: Sequence[dict[str, Any]], where: str, dtype: Any) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN401
        text, spans = self.spans(messages, where)
        enc = self.tok.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=dtype)
        mask = np.zeros(len(ids), dtype=bool)
        if len(ids):
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            for a, b in spans:  # a token that overlaps the turn's characters is the assistant's to predict
                mask |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
        return ids, mask


def chat_records(path: str, field: str = "messages") -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(line number, checked messages) of each non-empty line of a chat jsonl file."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as exc:
                raise ChatDataError(f"{where}: not valid JSON ({str(exc).splitlines()[0][:120]})") from None
            if not isinstance(rec, dict) or field not in rec:
                raise ChatDataError(f"{where}: no field {field!r} (data.format chat reads each line's "
                                    f"{field!r} list of {{role, content}} messages)")
            yield lineno, check_messages(rec[field], where)
