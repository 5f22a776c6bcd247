"""Language-model loss as a SUM over target tokens; the engine divides by the global token count.

Normalisation contract: every micro-batch contributes sum(loss over its targets) / (target tokens of the whole
global batch: all micro-batches, all dp ranks), so accumulation and data parallelism give the gradient of one big
batch. `linear_cross_entropy` is the swap point for the fused kernel (it never needs the full logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seqtrain.data import IGNORE_INDEX


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T, targets) (reference: materialises the logits)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=ignore_index, reduction="sum")


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
        return linear_cross_entropy(hidden, self.model.output_weight, targets)
