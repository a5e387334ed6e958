"""Fused bias + GeLU (tanh approximation), the MLP's activation after its first linear.

Both paths compute gelu_tanh(x + b) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), z = x + b.
On CUDA with triton, one elementwise kernel does the bias add and the activation (forward) and one
computes dz from the saved input (backward), so the pre-activation sum is never materialized;
elsewhere torch's gelu(approximate="tanh") runs on x + b.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # CPU builds and machines without triton use torch's kernel
    HAS_TRITON = False

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_BLOCK = 1024


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The tanh-approximated GeLU written out, in fp32."""
    z = x.float() + bias.float()
    y = 0.5 * z * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z ** 3)))
    return y.to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias), bias broadcast over the last dim."""
    if HAS_TRITON and x.is_cuda and not torch.compiler.is_compiling():  # Inductor fuses the plain ops itself
        return _TritonBiasGelu.apply(x, bias)
    return F.gelu(x + bias, approximate="tanh")


if HAS_TRITON:

    @triton.jit
    def _tanh_parts(z):
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        return 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner), portable across triton versions

    @triton.jit
    def _bias_gelu_fwd_kernel(X, B, Y, n_elements, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
        z = x + b
        t = _tanh_parts(z)
        tl.store(Y + offs, (0.5 * z * (1.0 + t)).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_bwd_kernel(DY, X, B, DZ, n_elements, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        z = x + b
        t = _tanh_parts(z)
        dgelu = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
        tl.store(DZ + offs, (dy * dgelu).to(DZ.dtype.element_ty), mask=mask)


class _TritonBiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if bias.shape != x.shape[-1:]:
            raise ValueError(f"bias shape {tuple(bias.shape)} must equal x's last dim {x.shape[-1]}")
        xc = x.contiguous()
        y = torch.empty_like(xc)
        n = xc.numel()
        _bias_gelu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](xc, bias, y, n, x.shape[-1], BLOCK=_BLOCK)
        ctx.save_for_backward(xc, bias)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xc, bias = ctx.saved_tensors
        dy = dy.contiguous()
        dz = torch.empty_like(xc)
        n = xc.numel()
        _bias_gelu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](dy, xc, bias, dz, n, xc.shape[-1], BLOCK=_BLOCK)
        dbias = dz.reshape(-1, xc.shape[-1]).float().sum(0).to(bias.dtype)
        return dz, dbias
