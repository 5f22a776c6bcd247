"""Language-model loss as a SUM over target tokens; the engine divides by the global token count.

Normalisation contract: every micro-batch contributes sum(loss over its targets) / (target tokens of the whole
global batch: all micro-batches, all dp ranks), so accumulation and data parallelism give the gradient of one big
batch. With `optimization.kernels` on (the model's `use_kernels`, set by `seqtrain.models.dispatch`) the loss is
`seqtrain.kernels.linear_cross_entropy` (Triton); otherwise `chunked_linear_cross_entropy` below, the same
algorithm in PyTorch ops. Neither materialises the float32 [tokens, vocab] logits: the logits exist one chunk of
tokens at a time, and the gradients are computed in the forward (the loss needs the same softmax). Where the
vocabulary is no wider than the model the logits are no larger than the hidden states, and the plain
`F.cross_entropy` runs (cheaper there, nothing to save).

Padded vocabularies (`model.padVocabTo`): the output weight has more rows than the vocabulary; `vocab` names the
real ones, and the logits of the pad rows are -inf before the softmax (no probability, no gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seqtrain import kernels as K
from seqtrain.data import IGNORE_INDEX


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    *, kernels: bool = False, vocab: int | None = None,
) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), with the logits of rows `vocab:` of `weight`
    (vocabulary padding) left out of the softmax."""
    if kernels:
        if vocab is not None and vocab < weight.shape[0]:
            weight = weight[:vocab]  # the kernel has no pad mask: the real rows (a contiguous view)
        return fused_linear_cross_entropy_sum(hidden, weight, targets, ignore_index)
    if weight.shape[0] <= hidden.shape[-1]:
        # Logits no larger than the hidden states (a character-level vocabulary): nothing to save by chunking,
        # and PyTorch's fused log-softmax + NLL is cheaper than the chunk loop (nanoGPT's shakespeare_char size).
        logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
        if vocab is not None and vocab < weight.shape[0]:
            logits = logits[:, :vocab]  # the pad rows: no probability, no gradient
        return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=ignore_index, reduction="sum")
    return chunked_linear_cross_entropy(hidden, weight, targets, ignore_index, vocab=vocab)


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast (or type promotion) gives `hidden @ weight.T`."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _mm_into_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out (+)= a @ b into the float32 `out` in place. Low-precision operands: cuBLAS's float32 output where torch
    has it; elsewhere they are widened first (chunk-sized copies), never an `out`-sized temporary."""
    if a.dtype != torch.float32 and a.is_cuda:
        try:
            if accumulate:
                torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            else:
                torch.mm(a, b, out_dtype=torch.float32, out=out)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    a, b = a.float(), b.float()
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def default_chunk(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: the chunk's float32 logits about the size of the hidden states (one chunk when the
    vocabulary is no wider than the model), at least 256 tokens so each matmul stays large."""
    return max(1, min(tokens, max(256, tokens * hidden // max(1, vocab))))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                ignore_index: int, vocab: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
        d = hidden.shape[-1]
        h = hidden.reshape(-1, d).to(dtype)
        w = weight.to(dtype)
        t = targets.reshape(-1)
        n, rows = h.shape[0], w.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty(n, d, dtype=torch.float32, device=h.device) if want_h else None
        dw = torch.zeros(rows, d, dtype=torch.float32, device=h.device) if want_w else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            z = (h[start:end] @ w.t()).float()  # [C, rows]: the only vocabulary-wide float32 buffer alive
            if vocab < rows:
                z[:, vocab:] = float("-inf")
            tc = t[start:end]
            valid = tc != ignore_index
            safe = torch.where(valid, tc, 0)[:, None]
            lse = torch.logsumexp(z, dim=-1)
            loss += torch.where(valid, lse - z.gather(1, safe)[:, 0], 0.0).sum()
            if dh is None and dw is None:
                continue
            # d(sum loss)/dz = softmax(z) - onehot(t) on valid rows, 0 on ignored ones; written over z
            g = z.sub_(lse[:, None]).exp_()
            g.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=g.dtype))
            g.mul_(valid[:, None])
            g = g.to(dtype)
            if dh is not None:
                _mm_into_f32(g, w, dh[start:end], accumulate=False)
            if dw is not None:
                _mm_into_f32(g.t(), h[start:end], dw, accumulate=True)
        ctx.save_for_backward(dh, dw)
        ctx.meta = (hidden.shape, hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        dh, dw = ctx.saved_tensors
        shape, h_dtype, w_dtype = ctx.meta
        g = grad_out.float()
        grad_h = (dh * g).to(h_dtype).view(shape) if dh is not None else None
        grad_w = (dw * g).to(w_dtype) if dw is not None else None
        return grad_h, grad_w, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    *, vocab: int | None = None, chunk: int | None = None,
) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T, targets) in float32 (the float32 loss of
    `F.cross_entropy(logits.float(), ...)`), chunk by chunk of `chunk` tokens: the logits matmul runs in the
    autocast dtype (as the plain matmul would), the softmax in float32, and the gradients are accumulated in
    float32 during the forward. Rows `vocab:` of `weight` (padding) get -inf logits."""
    rows = weight.shape[0]
    vocab = rows if vocab is None else vocab
    if not 0 < vocab <= rows:
        raise ValueError(f"linear_cross_entropy: vocab {vocab} must be in [1, {rows}] (the weight's rows)")
    n = hidden.numel() // max(1, hidden.shape[-1])
    size = chunk or default_chunk(n, hidden.shape[-1], rows)
    dtype = _matmul_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):  # the Function picks each op's precision itself
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, ignore_index, vocab, size, dtype)


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
                                    kernels=getattr(self.model, "use_kernels", False),
                                    vocab=getattr(self.model, "vocab_size", None))
