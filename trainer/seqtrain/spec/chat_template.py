"""Where a tokenizer folder keeps its chat template (torch- and numpy-free: `validate` checks it, the chat data
loader in `seqtrain.data.chat` renders it): `chat_template` in tokenizer_config.json (a string, or named templates
of which transformers takes "default"), else a chat_template.jinja file beside tokenizer.json."""

from __future__ import annotations

import json
import os
from typing import Any

FIELD = "spec.data.format"
CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_MAX_BYTES = 1 << 20  # templates are kilobytes; the config file may also hold a large added vocabulary
CONFIG_MAX_BYTES = 64 << 20


def token_text(value: Any) -> str:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def template_of(tokenizer_json: str) -> tuple[str, dict[str, Any]]:
    """(template source, tokenizer_config.json) of the folder holding `tokenizer_json`; ValueError (one line naming
    spec.data.format) when it has no chat template."""
    folder = os.path.dirname(os.path.abspath(tokenizer_json))
    config: dict[str, Any] = {}
    cfg_path = os.path.join(folder, CONFIG)
    if os.path.isfile(cfg_path) and os.path.getsize(cfg_path) <= CONFIG_MAX_BYTES:
        try:
            with open(cfg_path, encoding="utf-8") as f:
                loaded = json.load(f)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{FIELD}: chat reads the chat template of {cfg_path}, which is not valid JSON "
                             f"({str(exc).splitlines()[0][:120]})") from None
        config = loaded if isinstance(loaded, dict) else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers takes "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_path = os.path.join(folder, TEMPLATE_FILE)
    if not isinstance(template, str) and os.path.isfile(jinja_path):
        if os.path.getsize(jinja_path) > TEMPLATE_MAX_BYTES:
            raise ValueError(f"{FIELD}: {jinja_path} is larger than {TEMPLATE_MAX_BYTES >> 10} KiB, not a chat "
                             "template")
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{FIELD}: chat needs a chat template beside {tokenizer_json} (chat_template in "
                         f"{CONFIG} or a {TEMPLATE_FILE} file) and {folder} has none; use the instruct model's "
                         "tokenizer folder, or data.format text")
    return template, config
