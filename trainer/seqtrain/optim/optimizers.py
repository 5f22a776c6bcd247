"""Optimizers beyond AdamW: LAMB, LARS (layer-wise trust ratios), Adafactor and SGD with momentum.

Parameter groups (weight-decay exclusions for norms and biases, `embeddingLrScale` for embeddings) come from
`seqtrain.optim.build.param_groups`; `make_optimizer` only picks the update rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from seqtrain.spec.training import OptimizerSpec


class _TrustRatioMixin:
    """Norms for trust ratios over the *whole* tensor: a tensor-parallel slice's squared norm is summed over the
    tensor-parallel group (`shard_norms`), so every rank applies the single-process ratio to its slice."""

    _tp_params: set[int] = set()
    _tp_group: Any = None

    def shard_norms(self, params: Iterable[torch.Tensor], group: Any) -> None:
        """Declare `params` as slices of larger tensors split over `group` (tensor parallel)."""
        self._tp_params = {id(p) for p in params}
        self._tp_group = group

    def _norm(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        n = torch.linalg.vector_norm(t)
        if hasattr(n, "full_tensor"):  # a DTensor (FSDP2): its norm is already reduced over the shards
            n = n.full_tensor()
        if id(p) in self._tp_params:
            sq = n.double().square()
            dist.all_reduce(sq, group=self._tp_group)  # a collective, not a host sync
            n = sq.sqrt().to(n.dtype)
        return n


class Lamb(_TrustRatioMixin, Optimizer):
    """LAMB (You et al. 2019): Adam direction, rescaled per parameter by the trust ratio ||w|| / ||update||.

    update = m_hat / (sqrt(v_hat) + eps) + wd * w;  w -= lr * clamp(||w|| / ||update||, <= max_trust) * update.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, max_trust: float = 10.0) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "adapt": True,
                    "max_trust": max_trust}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat = m / (1 - b1 ** state["step"])
                v_hat = v / (1 - b2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                if group["adapt"]:
                    update.mul_(_trust_ratio(self._norm(p.float(), p), self._norm(update, p), group["max_trust"]))
                p.add_(update.to(p.dtype), alpha=-group["lr"])
        return loss


class Lars(_TrustRatioMixin, Optimizer):
    """LARS (You et al. 2017): SGD momentum on lr * eta * ||w|| / (||g|| + wd ||w||) * (g + wd w), per parameter."""

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001, eps: float = 1e-8) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta, "eps": eps,
                    "adapt": True}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                if group["adapt"]:
                    w_norm = self._norm(p.float(), p)
                    g_norm = self._norm(g, p)
                    local = group["eta"] * w_norm / (g_norm + wd * w_norm + group["eps"])
                    # tensors, no host sync: a zero weight or zero gradient falls back to the plain lr
                    local = torch.where((w_norm > 0) & (g_norm > 0), local, torch.ones_like(local))
                else:
                    local = torch.ones((), device=p.device)
                d = (g + wd * p.float()) * local
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = d.clone()
                else:
                    buf.mul_(group["momentum"]).add_(d)
                p.add_(buf.to(p.dtype), alpha=-group["lr"])
        return loss


def _trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, max_trust: float) -> torch.Tensor:
    ratio = (w_norm / u_norm).clamp(max=max_trust)
    # stays on device (no sync); zero weights (fresh biases) or zero updates use the plain lr
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))


def make_optimizer(groups: list[dict[str, Any]], spec: OptimizerSpec) -> Optimizer:
    """The optimizer named in `training.optimizer` over parameter groups from `seqtrain.optim.build.param_groups`.

    LAMB/LARS apply their trust ratio only to groups with weight decay (matrices and embeddings), never to
    norm scales and biases, as in the papers.
    """
    groups = [dict(g, adapt=g.get("weight_decay", 0.0) > 0) for g in groups]
    name = spec.name
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps)
    if name == "lamb":
        return Lamb(groups, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps)
    if name == "lars":
        return Lars(groups, lr=spec.lr, momentum=spec.momentum)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum)
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise RuntimeError("training.optimizer.name adafactor needs torch>=2.5; use adamw or lamb")
        # Factored second moments (row/column statistics) for matrices and no first moment: optimizer state is
        # O(rows + cols) per matrix instead of AdamW's 2 x rows x cols. Weight decay is decoupled (x lr).
        return torch.optim.Adafactor(groups, lr=spec.lr)
    raise ValueError(f"spec.training.optimizer.name: unknown optimizer {name!r}")
