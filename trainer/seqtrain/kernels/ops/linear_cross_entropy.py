"""Fused linear + cross entropy that never holds the full [tokens, vocab] logits.

    L = mean over tokens i with t_i != ignore_index of  lse(h_i W^T) - (h_i W^T)_{t_i}
For each chunk of C tokens (C * V logits at a time):
    Z  = H_c W^T                                  (cuBLAS / torch matmul, input dtype)
    G  = (softmax(Z) - onehot(t_c)) / n_valid     (Triton kernel, written over Z in place)
    dH_c = G W,   dW += G^T H_c                 (both float32: one rounding at the end, like autograd;
                                                 dW accumulated in place, `addmm_f32_`)
The gradients are computed during the forward (the loss needs the same softmax), kept, and scaled
by the incoming gradient in the backward. Peak extra memory is one [C, V] chunk plus dH [N, hidden]
and dW [V, hidden] (both float32), instead of [N, V] logits and their gradient. By default C is chosen
so that C * V is about N * hidden, i.e. the chunk is as large as the hidden states themselves.
"""

from __future__ import annotations

import torch
import triton

from seqtrain.kernels import _alloc
from seqtrain.kernels.ops.cross_entropy import ce_rows_with_grad_


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 result, without rounding low-precision products to a.dtype first."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)  # cuBLAS: low-precision in, float32 out
        except (RuntimeError, TypeError):
            pass
    return a.float() @ b.float()


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in place into the float32 `acc`, never allocating an `acc`-sized temporary (at vocab 128k a
    [V, hidden] float32 product per chunk is most of this kernel's memory traffic): float32 operands directly;
    low-precision ones with cuBLAS's float32 output (`addmm(out_dtype=)`) where torch has it, else widened to
    float32 first, which copies only the chunk-sized operands."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    acc.addmm_(a.float(), b.float())


def default_chunk_size(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk so that the chunk logits are about the size of the hidden states."""
    return min(max(1, tokens), triton.next_power_of_2(max(1, triton.cdiv(tokens, triton.cdiv(vocab, hidden)))))


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                chunk_size: int | None, need_grad: bool) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        t = target.reshape(-1).contiguous()
        n, d = h.shape
        vocab = weight.shape[0]
        chunk = chunk_size or default_chunk_size(n, d, vocab)
        n_valid = (t != ignore_index).sum()  # on the device: no sync
        scale = (1.0 / n_valid.float()).reshape(1)  # inf when nothing is valid; the loss is NaN then
        want_dh = need_grad and ctx.needs_input_grad[0]
        want_dw = need_grad and ctx.needs_input_grad[1]
        dh = _alloc.empty(n, d, dtype=torch.float32, device=hidden.device) if want_dh else None
        dw = torch.zeros(vocab, d, dtype=torch.float32, device=hidden.device) if want_dw else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # dH's product with float32 output: cuBLAS takes low-precision operands (`_mm_f32`); elsewhere the weight
        # is widened once here, not once per chunk
        w_dh = weight.float() if dh is not None and not weight.is_cuda else weight
        for start in range(0, n, chunk):
            h_c = h[start:start + chunk]
            logits = h_c @ weight.t()  # [C, V]: the only vocab-sized buffer alive
            loss_sum += ce_rows_with_grad_(logits, t[start:start + chunk], scale, ignore_index).sum()
            if dh is not None:
                dh[start:start + chunk] = _mm_f32(logits, w_dh)
            if dw is not None:
                addmm_f32_(dw, logits.t(), h_c)
            del logits
        ctx.save_for_backward(dh, dw)
        ctx.shapes = (hidden.shape, hidden.dtype, weight.dtype)
        # Under autocast cross-entropy is a float32 op (as F.cross_entropy is there): keep the float32 loss instead
        # of rounding the reported value to bf16/fp16. Outside autocast follow the input dtype like the reference.
        out_dtype = torch.float32 if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype
        return (loss_sum * scale[0]).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dh, dw = ctx.saved_tensors
        hidden_shape, h_dtype, w_dtype = ctx.shapes
        g = grad_out.float()
        grad_h = (dh * g).to(h_dtype).view(hidden_shape) if dh is not None else None
        grad_w = (dw * g).to(w_dtype) if dw is not None else None
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int = -100, chunk_size: int | None = None) -> torch.Tensor:
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return LinearCrossEntropyFunction.apply(hidden, weight, target, ignore_index, chunk_size, need_grad)
