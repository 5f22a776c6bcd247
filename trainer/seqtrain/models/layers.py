"""Building blocks of the GPT decoder, each a small function with a module around it.

The functions (`rms_norm`, `layer_norm`, `swiglu`, `rope`, `attention`) are the reference path and have the signatures of
`seqtrain.kernels`. Each module below has a `use_kernels` flag (False by default; set per instance by
`seqtrain.models.dispatch.apply_kernels` when `optimization.kernels` resolves to on): with it the module calls
the `seqtrain.kernels` function instead (Triton on CUDA or under TRITON_INTERPRET=1, chosen per call).
Importing `seqtrain.kernels` never imports triton.

`CausalSelfAttention` and `SwiGLU` also have a `fuse_projections` flag (set by
`seqtrain.models.dispatch.apply_fused_projections` when `optimization.fusedProjections` resolves to on): q/k/v, and
gate/up, then run as one GEMM on their concatenated weights (`fused_linear`) while the parameters stay split.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from seqtrain import kernels as K

if TYPE_CHECKING:
    from seqtrain.spec.model import RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in at least fp32 for stability. `F.rms_norm`: one fused
    kernel where torch has one (CUDA); on the CPU its decomposition is bit for bit x * rsqrt(mean(x^2) + eps) * w."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return F.rms_norm(x.to(wide), (x.shape[-1],), weight.to(wide), eps).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension (torch's LayerNorm, GPT-2's)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): GPT-2's gelu_new."""
    return F.gelu(x, approximate="tanh")


def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    """The exact GELU, x Phi(x) = 0.5 x (1 + erf(x / sqrt(2))): torch's `nn.GELU()` (nanoGPT's), transformers'
    activation_function "gelu"."""
    return F.gelu(x)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, H, T, Dh] with cos/sin [T, Dh/2] (pairs are the two halves of the head dim)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_tables(seq_len: int, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, head_dim/2] in fp32, with `scaling` applied to the frequencies (and yarn's
    attention factor to the tables) as transformers' `modeling_rope_utils` does; `max_seq_len`: the model's
    context, yarn's default for the original one."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    factor = 1.0
    if scaling is not None:
        inv_freq, factor = scaled_inv_freq(inv_freq, head_dim, theta, scaling, max_seq_len or seq_len)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    if factor == 1.0:
        return angles.cos().float(), angles.sin().float()
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()


def scaled_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling,
                    max_seq_len: int) -> tuple[torch.Tensor, float]:
    """(scaled inverse frequencies, factor on cos/sin) of `RopeScaling` `s`, following transformers'
    `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters` and `_compute_yarn_parameters`."""
    if s.type == "linear":
        return inv_freq / s.factor, 1.0
    old = s.original_max_seq_len or max_seq_len
    if s.type == "llama3":
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * out / s.factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out), 1.0
    # yarn

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
        else:
            attention = mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    freq = inv_freq * (1 - extrapolation) / s.factor + inv_freq * extrapolation
    return freq, float(attention)


def kernel_rope_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's half tables ([T, Dh/2], or [B, 1, T, Dh/2] per packed document) in the layout of
    `seqtrain.kernels.rope` ([T, Dh] or [B, T, Dh], both halves repeated), cast to `dtype` like `rope` does."""
    if cos.dim() == 4:
        cos, sin = cos[:, 0], sin[:, 0]
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


def document_mask(doc_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean [B, 1, T, T] mask (the CPU path; CUDA uses `flex_document_attention`): position i may attend to j
    when j <= i, both lie in the same document and, with a sliding `window`, i - j < window."""
    t = doc_ids.shape[-1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal_mask(t, doc_ids.device, window))[:, None]


def causal_mask(t: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Boolean [T, T]: j <= i, and i - j < window with a sliding window (transformers' sliding_window_overlay)."""
    i = torch.arange(t, device=device)
    dist = i[:, None] - i[None, :]
    keep = dist >= 0
    return keep & (dist < window) if window is not None else keep


def window_applies(window: int | None, t: int) -> bool:
    """Whether a sliding window of `window` positions hides anything in a sequence of `t`."""
    return window is not None and t > window


_FLEX: dict[str, object] = {}  # the compiled flex_attention and the last block mask (shared by all layers)


@functools.lru_cache(maxsize=1)
def flex_available() -> bool:
    """Whether this torch has `flex_attention`. Imported, not looked up: `torch.nn.attention.flex_attention` is a
    submodule that nothing imports for us, so `hasattr(torch.nn.attention, "flex_attention")` is False in a
    fresh process and packed documents would silently fall to a dense [B, 1, T, T] mask."""
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return False
    return True


def doc_block_mask(doc_ids: torch.Tensor, causal: bool = True, window: int | None = None) -> object:
    """The flex_attention BlockMask of packed documents `doc_ids` [B, T] (causal inside each document, and within
    a sliding `window`). Built once per batch by the model, outside its (compiled) blocks: built inside, every new
    batch would be a new constant of the compiled graph, that is a recompile per batch."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        same = doc_ids[b, qi] == doc_ids[b, ki]
        if window is not None:
            same = same & (qi - ki < window)
        return same & (ki <= qi) if causal else same

    b, t = doc_ids.shape
    return create_block_mask(mask_mod, b, None, t, t, device=doc_ids.device)


def flex_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None, causal: bool = True,
    compiled: bool = True, block_mask: object | None = None, window: int | None = None,
) -> torch.Tensor:
    """Packed-document attention with `flex_attention` and a block-sparse document mask: no [B, 1, T, T]
    tensor, blocks entirely outside a document are skipped, and flash-style kernels run (compiled). The model
    passes `block_mask` (`doc_block_mask`, built once per batch); without it the mask is built here, once per
    `doc_ids` tensor, and reused by every layer of the forward."""
    from torch.nn.attention.flex_attention import flex_attention

    if block_mask is None:
        assert doc_ids is not None
        cached = _FLEX.get("mask")
        if cached is not None and cached[0] is doc_ids and cached[1] == (causal, window):
            block_mask = cached[2]
        else:
            block_mask = doc_block_mask(doc_ids, causal, window)
            _FLEX["mask"] = (doc_ids, (causal, window), block_mask)
    fn = flex_attention
    if compiled:  # eager flex_attention materialises the scores; compiled it is a fused kernel
        fn = _FLEX.setdefault("fn", torch.compile(flex_attention, dynamic=False))
    return fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])  # type: ignore[operator]


def use_flex(q: torch.Tensor) -> bool:
    """flex_attention for packed documents on CUDA. PyTorch's CPU flex_attention has no backward (2.13), so
    the CPU keeps the dense boolean mask, which is exact and cheap at CPU sizes."""
    return q.is_cuda and flex_available()


def gqa_by_copy(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether SDPA gets grouped kv heads expanded to one per query head instead of `enable_gqa`. On CUDA only
    the FLASH (and cuDNN) kernels take `enable_gqa`, and they run in fp16/bf16 alone: fp32 with grouped heads
    would fall to the MATH kernel, which stores the [T, T] scores. A copy of k and v costs T x Dkv per head."""
    return q.is_cuda and k.shape[1] != q.shape[1] and q.dtype not in (torch.float16, torch.bfloat16)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, doc_ids: torch.Tensor | None = None,
    block_mask: object | None = None, window: int | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention on [B, H, T, Dh] (k/v may have fewer, grouped heads: SDPA's enable_gqa
    shares each kv head without copying it); with doc_ids [B, T] packed documents stay apart (`block_mask`:
    their flex_attention mask, prebuilt by the model on CUDA, the sliding window included). A causal sliding
    `window` longer than the sequence changes nothing; a shorter one is an explicit mask."""
    gqa = k.shape[1] != q.shape[1]
    t = q.shape[2]
    if not window_applies(window, t):
        window = None
    if block_mask is not None or (doc_ids is not None and use_flex(q)):
        return flex_document_attention(q, k, v, doc_ids, causal, block_mask=block_mask, window=window)
    if gqa and gqa_by_copy(q, k):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa = False
    if doc_ids is None:
        if window is not None and causal:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(t, q.device, window),
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    mask = document_mask(doc_ids, window) if causal else (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class _FusedLinear(torch.autograd.Function):
    """x @ cat(weights).T (+ cat(biases)) as one GEMM, returned split by each weight's rows.

    Saves x and the parameters themselves, not their concatenation: autograd saving the concatenated copy would
    hold a second copy of the projection weights of every block until backward (under FSDP2 an unsharded one,
    which FSDP frees after the forward). Backward concatenates again and runs one GEMM for the input gradient and
    one for the weight gradients. Under autocast x and the weights are cast to the autocast dtype, as autocast's
    linear casts them (the same rule as `seqtrain.parallel.sequence._GatherLinears`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights, biases = params[:n], params[n:]
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        xc = x.to(dtype)
        w = torch.cat([p.to(dtype) for p in weights])
        b = torch.cat([p.to(dtype) for p in biases]) if biases else None
        ctx.n, ctx.x_dtype, ctx.has_bias = n, x.dtype, bool(biases)
        ctx.save_for_backward(xc, *weights)
        y = F.linear(xc, w, b)
        return tuple(y.split([p.shape[0] for p in weights], dim=-1))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xc, *weights = ctx.saved_tensors
        g = torch.cat(grads, dim=-1)
        rows = [w.shape[0] for w in weights]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ torch.cat([w.to(g.dtype) for w in weights])).to(ctx.x_dtype)
        g2 = g.reshape(-1, g.shape[-1])
        grad_ws: list[torch.Tensor | None] = [None] * ctx.n
        if any(ctx.needs_input_grad[2:2 + ctx.n]):
            gw = g2.t() @ xc.reshape(-1, xc.shape[-1]).to(g.dtype)
            grad_ws = [part.to(w.dtype) for part, w in zip(gw.split(rows), weights, strict=True)]
        grad_bs: list[torch.Tensor | None] = [None] * (ctx.n if ctx.has_bias else 0)
        if ctx.has_bias and any(ctx.needs_input_grad[2 + ctx.n:]):
            grad_bs = [part.to(w.dtype) for part, w in zip(g2.sum(0).split(rows), weights, strict=True)]
        return (grad_x, None, *grad_ws, *grad_bs)


def fusable(linears: tuple[nn.Module, ...]) -> bool:
    """Whether `fused_linear` may replace these modules' own forwards: every one exactly `nn.Linear` (a LoRA
    adapter, a float8 or any other subclass has a forward of its own, so it keeps it) and all with a bias or none."""
    return (all(type(lin) is nn.Linear for lin in linears)
            and len({lin.bias is None for lin in linears}) == 1)


def fused_linear(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    """(lin(x) for lin in linears) as ONE GEMM on the linears' concatenated weights (and biases), split by each
    weight's row count (under tensor parallel the local shard's). Why: one large GEMM keeps the GPU busier than
    three narrow ones (k and v are narrow with grouped-query attention) and reads x once; llm.c and Megatron fuse
    q/k/v and gate/up the same way. The concatenation copies the weights in every forward (about 3 x dim x dim x
    2 bytes in bf16 for q/k/v), which is small against the GEMM itself. The parameters stay split, so checkpoint
    and optimizer-state names, the HF import/export maps, tensor-parallel and FSDP2 sharding, LoRA and pipeline
    stages are untouched. The caller checks `fusable` first."""
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears if lin.bias is not None]
    return _FusedLinear.apply(x, len(weights), *weights, *biases)


class RMSNorm(nn.Module):
    use_kernels = False  # per instance: seqtrain.models.dispatch.apply_kernels

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            return K.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and, unless `bias` is False, a bias (GPT-2's; nanoGPT's `LayerNorm(ndim, bias)`)."""

    use_kernels = False  # per instance: seqtrain.models.dispatch.apply_kernels

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # None without a bias: no parameter, so no state-dict key; F.layer_norm and the kernel both accept None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            return K.layer_norm(x, self.weight, self.bias, self.eps)
        return layer_norm(x, self.weight, self.bias, self.eps)


def make_norm(kind: str, dim: int, eps: float, bias: bool | None = None) -> RMSNorm | LayerNorm:
    """`model.norm`: rmsnorm or layernorm; `bias` (`model.normBias`): None is the norm's own default (layernorm
    has a bias, rmsnorm none)."""
    if kind == "layernorm":
        return LayerNorm(dim, eps, bias=bias is not False)
    if bias:
        raise ValueError("RMSNorm has no bias: normBias true needs norm layernorm")
    return RMSNorm(dim, eps)


class SwiGLU(nn.Module):
    """LLaMA-style MLP: down(silu(gate(x)) * up(x))."""

    use_kernels = False
    fuse_projections = False  # per instance: seqtrain.models.dispatch.apply_fused_projections

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=bias)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = K.swiglu if self.use_kernels else swiglu
        if self.fuse_projections and fusable(self.projections()):
            gate, up = fused_linear(x, self.projections())
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(act(gate, up))

    def projections(self) -> tuple[nn.Module, ...]:
        """The linears `fuse_projections` runs as one GEMM."""
        return self.gate, self.up


class GeluMLP(nn.Module):
    """GPT-2-style MLP: down(gelu(up(x))), GELU's tanh approximation (`approximate="tanh"`, `gelu_tanh`: GPT-2's
    gelu_new, `model.mlp: gelu`) or the exact erf form (`approximate="none"`, `gelu_exact`: nanoGPT's `nn.GELU()`,
    `model.mlp: gelu-exact`). No kernel of its own (torch.compile fuses it)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be tanh or none, not {approximate!r}")
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = gelu_tanh if self.approximate == "tanh" else gelu_exact
        return self.down(act(self.up(x)))


class CausalSelfAttention(nn.Module):
    """q/k/v projections (optionally with biases and Qwen3's RMSNorm of q and k per head), RoPE (unless the model
    has learned positions), causal attention within an optional sliding window, output projection."""

    use_kernels = False  # kernels: fused RoPE and flash attention (doc_ids: no [T, T] mask is built)
    fuse_projections = False  # q/k/v as one GEMM (`fused_linear`): seqtrain.models.dispatch.apply_fused_projections

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int | None = None, *, qkv_bias: bool = False,
                 out_bias: bool = False, qk_norm: bool = False, norm_eps: float = 1e-5, rope: bool = True,
                 window: int | None = None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim or dim // heads
        self.rope, self.window = rope, window
        self.q = nn.Linear(dim, heads * self.head_dim, bias=qkv_bias)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=qkv_bias)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=qkv_bias)
        self.out = nn.Linear(heads * self.head_dim, dim, bias=out_bias)
        if qk_norm:  # after the projections in parameter order, as transformers' Qwen3 lists them
            self.q_norm = RMSNorm(self.head_dim, norm_eps)
            self.k_norm = RMSNorm(self.head_dim, norm_eps)
        self.qk_norm = qk_norm

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc_ids: torch.Tensor | None = None,
        block_mask: object | None = None,
    ) -> torch.Tensor:
        q, k, v = self.project(x)
        return self.attend(q, k, v, cos, sin, doc_ids, block_mask)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, heads*Dh], k/v [B, T, kv_heads*Dh]: one fused GEMM with `fuse_projections` (when the three
        are plain linears), else three. Shared by training and the KV-cache decoder (`seqtrain.generate`)."""
        if self.fuse_projections and fusable(self.projections()):
            q, k, v = fused_linear(x, self.projections())
            return q, k, v
        return self.q(x), self.k(x), self.v(x)

    def projections(self) -> tuple[nn.Module, ...]:
        """The linears `fuse_projections` runs as one GEMM."""
        return self.q, self.k, self.v

    def split_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections [B, T, heads*Dh] -> [B, heads, T, Dh] per head, q and k normalised (qkNorm), before RoPE.
        Shared by training and the KV-cache decoder (`seqtrain.generate`)."""
        b, t, _ = q.shape
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        doc_ids: torch.Tensor | None = None, block_mask: object | None = None,
    ) -> torch.Tensor:
        """Projected q [B, T, heads*Dh], k/v [B, T, kv_heads*Dh] -> RoPE, attention, output projection. Split
        from `forward` so sequence parallel can compute the three projections in one fused function."""
        b, t, _ = q.shape
        q, k, v = self.split_heads(q, k, v)
        # seqtrain.kernels.attention has no sliding window: where the window hides positions, the reference runs
        window = self.window if window_applies(self.window, t) else None
        if self.use_kernels:
            if self.rope:
                cos_k, sin_k = kernel_rope_tables(cos, sin, q.dtype)
                q, k = K.rope(q, cos_k, sin_k), K.rope(k, cos_k, sin_k)
            if window is None:
                y = K.attention(q, k, v, causal=True, doc_ids=doc_ids)
            else:
                y = attention(q, k, v, causal=True, doc_ids=doc_ids, block_mask=block_mask, window=window)
        else:
            if self.rope:
                q, k = rope(q, cos, sin), rope(k, cos, sin)
            y = attention(q, k, v, causal=True, doc_ids=doc_ids, block_mask=block_mask, window=window)
        return self.out(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its own document [B, T] (restarts at 0 where doc_ids changes)."""
    b, t = doc_ids.shape
    idx = torch.arange(t, device=doc_ids.device).expand(b, t)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx
