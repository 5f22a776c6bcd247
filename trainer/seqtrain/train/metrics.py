"""metrics.jsonl (rank 0 only) and the memory peak of a rank."""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

import torch

from seqtrain.spec.status import json_safe


def peak_memory_mb(device: torch.device) -> float:
    """CUDA allocator peak on GPU; the process's peak resident set on CPU (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def json_line(record: dict[str, Any]) -> str:
    """One metrics.jsonl line: strict JSON. A non-finite figure (a diverged step's NaN loss) is written as null
    and its key listed in `non_finite`, so every reader (the operator, `seqtrain report`, jq) can parse the line."""
    safe = json_safe(record)
    bad = [k for k, v in record.items() if v is not None and safe.get(k) is None]
    if bad:
        safe["non_finite"] = sorted(set(bad) | set(safe.get("non_finite") or ()))
    return json.dumps(safe, allow_nan=False) + "\n"


class MetricsWriter:
    """Appends one JSON object per optimizer step; after a resume, lines past the resumed step are dropped
    first so a step never appears twice."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.last_step: int | None = None  # the highest step the file held before truncate_after (a resume)
        # tokens and training seconds (step_time_s) of the steps kept by truncate_after: the run's totals before
        # this trainer's first step, for its average tokens/s across restarts (seqtrain.obs.throughput)
        self.kept_tokens = 0.0
        self.kept_seconds = 0.0

    def truncate_after(self, step: int) -> int:
        """Keep only lines with step <= `step` (and unparsable tail lines are dropped). Returns lines kept."""
        self.kept_tokens = self.kept_seconds = 0.0
        if not os.path.exists(self.path):
            return 0
        kept = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash mid-write
                if not isinstance(rec, dict):
                    continue
                self.last_step = max(self.last_step or 0, int(rec.get("step", 0)))
                if int(rec.get("step", 0)) <= step:
                    kept.append(json_line(rec))
                    tokens, seconds = rec.get("tokens"), rec.get("step_time_s")
                    if isinstance(tokens, int | float) and isinstance(seconds, int | float) and seconds > 0:
                        self.kept_tokens += tokens
                        self.kept_seconds += seconds
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return len(kept)

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json_line(record))
