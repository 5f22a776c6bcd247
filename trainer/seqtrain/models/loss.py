"""Language-model loss as a SUM over target tokens; the engine divides by the global token count.

Normalisation contract: every micro-batch contributes sum(loss over its targets) / (target tokens of the whole
global batch: all micro-batches, all dp ranks), so accumulation and data parallelism give the gradient of one big
batch. With `optimization.kernels` on (the model's `use_kernels`, set by `seqtrain.models.dispatch`) the loss is
`seqtrain.kernels.linear_cross_entropy`, which never materialises the [tokens, vocab] logits; otherwise the
reference below (logits, then cross-entropy in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seqtrain import kernels as K
from seqtrain.data import IGNORE_INDEX


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    *, kernels: bool = False,
) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T, targets); the reference materialises the logits."""
    if kernels:
        return fused_linear_cross_entropy_sum(hidden, weight, targets, ignore_index)
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=ignore_index, reduction="sum")


def fused_linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The same sum through `seqtrain.kernels.linear_cross_entropy` (a mean over the valid targets, times their
    count). Under autocast both operands are cast to the autocast dtype first, as autocast does for the reference
    matmul, and the kernel runs with autocast off (its chunk matmuls and fp32 gradient buffers choose their own
    precision). The kernel returns the mean in that dtype: under bf16 the loss value is rounded to bf16, the
    gradients are not (they are accumulated in fp32)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    with torch.autocast(device, enabled=False):
        mean = K.linear_cross_entropy(hidden, weight, targets, ignore_index)
    count = (targets != ignore_index).sum()  # on the device: no sync
    # No target in this micro-batch: the kernel's mean is NaN (0/0) but the sum is 0, with zero gradients.
    return torch.where(count > 0, mean.float() * count, torch.zeros((), device=mean.device))


class CausalLMLoss(nn.Module):
    """Model + output projection + loss in one module, so a DDP/FSDP/DeepSpeed wrapper sees every parameter
    used inside its forward. Returns the loss SUM of the micro-batch."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.model(tokens, doc_ids)
        lm_loss = getattr(self.model, "lm_loss", None)
        if lm_loss is not None:  # tensor parallel: vocabulary-parallel projection + cross-entropy
            return lm_loss(hidden, targets)
        # TP keeps the vocabulary-parallel loss above: the fused kernel needs the whole vocabulary on one rank.
        return linear_cross_entropy(hidden, self.model.output_weight, targets,
                                    kernels=getattr(self.model, "use_kernels", False))
