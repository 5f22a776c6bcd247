"""Rank arithmetic of the dp x pp x tp mesh. Pure Python (no torch): the planner and the trainer share it.

Ranks are laid out with tensor parallel innermost, then pipeline, then data parallel outermost:

    rank = dp_index * (pp * tp) + pp_index * tp + tp_index

so a tensor-parallel group is `tp` consecutive ranks. Replicas own consecutive ranks too, so as long as `tp`
divides the processes per replica, every tensor-parallel group (one all-reduce per sublayer, the chattiest
traffic) stays inside one replica, i.e. one node; pipeline neighbours are the next-closest ranks and the
data-parallel all-reduce (once per step, overlappable) crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

# Model chunks per rank for the interleaved 1F1B schedule.
INTERLEAVED_CHUNKS = 2


@dataclass(frozen=True)
class Coord:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class MeshShape:
    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, c: Coord) -> int:
        return c.dp * (self.pp * self.tp) + c.pp * self.tp + c.tp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return Coord(dp=rank // (self.pp * self.tp), pp=(rank // self.tp) % self.pp, tp=rank % self.tp)

    def tp_groups(self) -> list[list[int]]:
        """Ranks that split each layer (same dp and pp index)."""
        return [[self.rank(Coord(d, p, t)) for t in range(self.tp)] for d in range(self.dp) for p in range(self.pp)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks that hold consecutive stages of one model replica (same dp and tp index), stage order."""
        return [[self.rank(Coord(d, p, t)) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks that hold the same shard and average gradients (same pp and tp index)."""
        return [[self.rank(Coord(d, p, t)) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def group_of(self, kind: str, rank: int) -> list[int]:
        groups = {"tp": self.tp_groups, "pp": self.pp_groups, "dp": self.dp_groups}[kind]()
        return next(g for g in groups if rank in g)


def bubble_fraction(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of a pipeline step: (p - 1) / (v * m + p - 1) (GPipe and 1F1B share it; 1F1B only saves memory).

    Interleaved 1F1B with v model chunks per rank cuts the bubble by v (Narayanan et al., 2021).
    """
    if stages <= 1:
        return 0.0
    v = virtual_stages if schedule == "interleaved" else 1
    idle = stages - 1
    return idle / (v * micro_batches + idle)


def balanced_split(costs: list[float], parts: int) -> list[tuple[int, int]]:
    """Split a sequence of per-item costs into `parts` contiguous [start, end) ranges minimizing the largest sum.

    Exact (dynamic programming over prefix sums): pipeline stages are few and layers are tens, so O(n^2 k) is
    nothing. Every part gets at least one item; among equally good splits the last part starts as late as
    possible, so the result is deterministic.
    """
    n = len(costs)
    if parts < 1:
        raise ValueError("parts must be at least 1")
    if n < parts:
        raise ValueError(f"cannot split {n} layers into {parts} pipeline stages: use at most {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-part-cost of splitting items[:i] into k parts; cut[k][i]: start of the last part.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cand = max(best[k - 1][j], prefix[i] - prefix[j])
                # <= : among equal splits keep the latest start of the last part, i.e. fewer items early.
                if cand < best[k][i] - 1e-12 or (abs(cand - best[k][i]) <= 1e-12 and j > cut[k][i]):
                    best[k][i] = cand
                    cut[k][i] = j
    bounds: list[tuple[int, int]] = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]
