"""Model size presets: plain data, so `seqtrain plan` and the trainer agree on every dimension.

Parameter counts (byte vocabulary, tied embeddings) are documented in docs/user-guide.md; they are computed by
`seqtrain.models.count_parameters`, never written by hand.
"""

from __future__ import annotations

from typing import Any

# dims per preset; anything not listed comes from ModelSpec defaults or the data section.
GPT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"dim": 64, "layers": 2, "heads": 4, "ffn_dim": 176},
    "mini": {"dim": 128, "layers": 4, "heads": 4, "ffn_dim": 344},
    "small": {"dim": 384, "layers": 6, "heads": 6, "ffn_dim": 1024},
    "125m": {"dim": 768, "layers": 12, "heads": 12, "ffn_dim": 2048},
    "350m": {"dim": 1024, "layers": 24, "heads": 16, "ffn_dim": 2816},
    "1b": {"dim": 2048, "layers": 20, "heads": 16, "kv_heads": 8, "ffn_dim": 5632},
}

RNN_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"dim": 64, "layers": 2},
    "mini": {"dim": 256, "layers": 2},
    "small": {"dim": 512, "layers": 3},
    "medium": {"dim": 1024, "layers": 3},
}


def presets_for(arch: str) -> dict[str, dict[str, Any]]:
    return GPT_PRESETS if arch == "gpt" else RNN_PRESETS
