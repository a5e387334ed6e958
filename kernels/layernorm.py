"""Fused LayerNorm: a Triton kernel on GPU (when triton imports), torch's own kernel elsewhere.

`layer_norm_reference` spells out the mean/variance math; tests hold both fast paths to it.
The Triton path fuses mean, variance, normalization and the affine transform into one pass per row
(forward) and computes dx in one pass per row (backward); the weight/bias gradients are column sums,
left to a torch reduction over the saved statistics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # CPU builds and machines without triton use torch's kernel
    HAS_TRITON = False

_MAX_TRITON_ROW_BYTES = 65536  # one row must fit in one program's registers/shared memory


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float = 1e-5) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, biased variance, fp32 math."""
    xf = x.float()
    mean = xf.mean(dim=-1, keepdim=True)
    var = ((xf - mean) ** 2).mean(dim=-1, keepdim=True)
    y = (xf - mean) / torch.sqrt(var + eps) * weight.float() + bias.float()
    return y.to(x.dtype)


def _triton_usable(x: torch.Tensor) -> bool:
    # Under torch.compile the plain op is better: Inductor fuses it with its neighbours (residual add,
    # the cast to bf16), which our standalone kernel cannot.
    return (HAS_TRITON and x.is_cuda and x.shape[-1] * x.element_size() <= _MAX_TRITON_ROW_BYTES
            and not torch.compiler.is_compiling())


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim; the fused Triton kernel on CUDA, F.layer_norm otherwise."""
    if _triton_usable(x):
        return _TritonLayerNorm.apply(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class LayerNorm(nn.Module):
    """nn.LayerNorm's parameters (weight=1, bias=0) with the fused kernel in forward."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


if HAS_TRITON:

    @triton.jit
    def _ln_fwd_kernel(X, Y, W, B, Mean, Rstd, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        y = xc * rstd * w + b
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Mean + row, mean)
        tl.store(Rstd + row, rstd)

    @triton.jit
    def _ln_bwd_dx_kernel(DY, X, W, Mean, Rstd, DX, N, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + row)
        rstd = tl.load(Rstd + row)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        wdy = tl.where(mask, w * dy, 0.0)
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)


class _TritonLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        rows = x2.shape[0]
        y = torch.empty_like(x2)
        mean = torch.empty(rows, device=x.device, dtype=torch.float32)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        block = triton.next_power_of_2(n)
        _ln_fwd_kernel[(rows,)](x2, y, weight, bias, mean, rstd, n, eps, BLOCK=block,
                                num_warps=min(max(block // 256, 1), 8))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        n = x2.shape[-1]
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty_like(x2)
        block = triton.next_power_of_2(n)
        _ln_bwd_dx_kernel[(x2.shape[0],)](dy2, x2, weight, mean, rstd, dx, n, BLOCK=block,
                                          num_warps=min(max(block // 256, 1), 8))
        xhat = (x2.float() - mean[:, None]) * rstd[:, None]
        dw = (dy2.float() * xhat).sum(0).to(weight.dtype)
        db = dy2.float().sum(0).to(weight.dtype)
        return dx.view(ctx.shape), dw, db, None
