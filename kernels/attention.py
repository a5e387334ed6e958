"""Causal self-attention with an optional sliding window (MegaScale section 3.1).

Window semantics: query i attends to key j iff i - window < j <= i; window = 0 means full causal.
Three implementations of the same math on q, k, v of shape [batch, heads, seq, head_dim]:

- `attention_reference`: softmax(Q K^T / sqrt(d) + mask) V written out (the test oracle).
- `sdpa_attention`: torch's scaled_dot_product_attention, `is_causal` for full attention and an
  explicit boolean mask for a window (CPU, and GPUs without triton).
- `flash_attention`: a Triton flash-attention forward (online softmax, key blocks outside the causal
  window are never visited). Its backward recomputes the forward through SDPA and differentiates that
  (no hand-written Triton backward yet): exact gradients, one extra attention forward in backward.
- `flex_window_attention`: torch's FlexAttention with a sliding-window block mask: compiled forward
  AND backward kernels that skip the blocks outside the window (what training needs).

`causal_attention` picks the fastest one that applies (timings in docs/model.md): for a sliding window
on CUDA, the Triton kernel when no gradient is needed and FlexAttention in training; SDPA otherwise.
Which of SDPA's own backends runs (flash, cuDNN, memory-efficient) is `sdpa_preference`'s to set
(`train.attention_backend`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # CPU builds and machines without triton use SDPA
    HAS_TRITON = False

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    HAS_FLEX = True
except ImportError:  # torch < 2.5
    HAS_FLEX = False

_FLASH_HEAD_DIMS = (16, 32, 64, 128)

SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
"""`train.attention_backend`'s choices: auto leaves torch's own order; a name puts that backend first."""


@contextlib.contextmanager
def sdpa_preference(backend: str) -> Iterator[None]:
    """Within the block, SDPA tries `backend` first and falls back to torch's other backends in their
    usual order where it does not apply (a shape or dtype it lacks, the CPU). torch.compile reads the
    same setting when it traces SDPA, so compiled blocks take the preferred kernel too. On Hopper the
    cuDNN backend (FlashAttention-3-style kernels) is the one to try: torch puts its FA2-based flash
    backend first."""
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"attention backend '{backend}' unknown; use one of: {', '.join(SDPA_BACKENDS)}")
    if backend == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    preferred = [order[backend]] + [b for name, b in order.items() if name != backend]
    with sdpa_kernel(preferred, set_priority=True):
        yield


def window_mask(seq_len: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean [seq, seq] mask, True where query i may attend key j (i - window < j <= i)."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window > 0:
        allowed = allowed & (j > i - window)
    return allowed


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + mask) V in fp32, masked scores set to -inf before the softmax."""
    s, d = q.shape[-2], q.shape[-1]
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(d)
    scores = scores.masked_fill(~window_mask(s, window, q.device), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
    s = q.shape[-2]
    if window <= 0 or window >= s:  # the window covers every earlier token: plain causal
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(s, window, q.device))


def flash_usable(q: torch.Tensor) -> bool:
    return HAS_TRITON and q.is_cuda and q.shape[-1] in _FLASH_HEAD_DIMS


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Causal (optionally sliding-window) attention; q, k, v are [batch, heads, seq, head_dim]."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must all be [batch, heads, seq, head_dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    # Full causal attention: SDPA's own flash backend beat this kernel 2x on an H200. A window: SDPA
    # has no fast path for a boolean mask and the Triton forward (which skips out-of-window blocks) is
    # 5-7x faster, but with gradients our SDPA-recompute backward makes fwd+bwd ~5% slower than plain
    # SDPA, so the kernel only runs when no gradient is needed (evaluation, inference).
    # In training, FlexAttention's compiled backward skips the out-of-window blocks too.
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if 0 < window < q.shape[-2] and q.is_cuda:
        if not needs_grad and flash_usable(q):
            return flash_attention(q, k, v, window)
        if needs_grad and HAS_FLEX:
            return flex_window_attention(q, k, v, window)
    return sdpa_attention(q, k, v, window)


def flex_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                          compiled: bool = True) -> torch.Tensor:
    """Sliding-window causal attention through FlexAttention. `compiled=False` runs torch's unfused
    reference implementation of it (any device; slow): the tests compare the two paths' math on CPU."""
    if not HAS_FLEX:
        raise RuntimeError("flex_window_attention needs torch.nn.attention.flex_attention (torch >= 2.5)")
    s = q.shape[-2]
    block_mask = _window_block_mask(s, window, str(q.device))
    attend = _compiled_flex() if compiled else flex_attention
    return attend(q, k, v, block_mask=block_mask)


@functools.cache
def _compiled_flex():
    # One compiled kernel per shape; flex_attention only reaches its fused speed through torch.compile.
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=8)
def _window_block_mask(seq_len: int, window: int, device: str):
    """The block mask of `i - window < j <= i` (cached: building it scans every block pair)."""

    def in_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return create_block_mask(in_window, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
    """The Triton kernel (CUDA + triton only); differentiable through an SDPA-recompute backward."""
    if not flash_usable(q):
        raise RuntimeError(f"flash_attention needs CUDA, triton and head_dim in {_FLASH_HEAD_DIMS}; "
                           "call causal_attention to fall back automatically")
    return _FlashAttention.apply(q, k, v, window)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        out = _flash_forward(q, k, v, window)
        ctx.save_for_backward(q, k, v)
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = sdpa_attention(qr, kr, vr, ctx.window)
            dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), grad_out)
        return dq, dk, dv, None


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                   blocks: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """blocks = (BLOCK_M, BLOCK_N, num_warps, num_stages); the bf16 default was the fastest of seven
    tried on an H200 (b=4, heads=16, s=4096, d=64 and 128, full and 512-token windows)."""
    b, h, s, d = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    fp32 = q.dtype == torch.float32
    if blocks is None:
        blocks = (32, 32, 4, 2) if fp32 and d > 64 else (64, 64, 4, 2) if fp32 else (64, 64, 4, 3)
    block_m, block_n, warps, stages = blocks
    grid = (triton.cdiv(s, block_m), b * h)
    _flash_fwd_kernel[grid](
        q, k, v, out, 1.0 / math.sqrt(d) * 1.4426950408889634,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, s, window if 0 < window < s else s,  # a window of s is plain causal: no branch in the kernel
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, IEEE=fp32, num_warps=warps, num_stages=stages)
    return out


if HAS_TRITON:

    @triton.jit
    def _flash_fwd_kernel(Q, K, V, Out, scale_log2,
                          sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod,
                          H, S, WINDOW,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                          IEEE: tl.constexpr):
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        bi = bh // H
        hi_ = bh % H
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + bi * sqb + hi_ * sqh + rows[:, None] * sqs + offs_d[None, :] * sqd,
                    mask=rows[:, None] < S, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # Causality bounds the key range above; the window bounds it below (whole blocks skipped).
        hi = tl.minimum((start_m + 1) * BLOCK_M, S)
        lo = (tl.maximum(start_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            kt = tl.load(K + bi * skb + hi_ * skh + cols[None, :] * sks + offs_d[:, None] * skd,
                         mask=cols[None, :] < S, other=0.0)
            if IEEE:
                qk = tl.dot(q, kt, input_precision="ieee") * scale_log2
            else:
                qk = tl.dot(q, kt) * scale_log2
            valid = (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - WINDOW)
            valid = valid & (cols[None, :] < S)
            qk = tl.where(valid, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row with no visible key in this block keeps m = -inf; shift by 0 to avoid inf - inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + bi * svb + hi_ * svh + cols[:, None] * svs + offs_d[None, :] * svd,
                        mask=cols[:, None] < S, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(Out + bi * sob + hi_ * soh + rows[:, None] * sos + offs_d[None, :] * sod,
                 acc.to(Out.dtype.element_ty), mask=rows[:, None] < S)
