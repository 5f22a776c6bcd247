"""metrics.jsonl (rank 0 only) and the memory peak of a rank."""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

import torch


def peak_memory_mb(device: torch.device) -> float:
    """CUDA allocator peak on GPU; the process's peak resident set on CPU (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


class MetricsWriter:
    """Appends one JSON object per optimizer step; after a resume, lines past the resumed step are dropped
    first so a step never appears twice."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.last_step: int | None = None  # the highest step the file held before truncate_after (a resume)

    def truncate_after(self, step: int) -> int:
        """Keep only lines with step <= `step` (and unparsable tail lines are dropped). Returns lines kept."""
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
                    kept.append(json.dumps(rec) + "\n")
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return len(kept)

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
