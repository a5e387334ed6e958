"""Full causal attention on one GPU, each of SDPA's backends alone (and FlexAttention), bf16, side by
side: which one `train.attention_backend` should put first.

    python benchmarks/sdpa_backends.py [--batch 4] [--heads 20] [--seq 2048] [--head-dim 128]

The default shape is one micro-batch of the gpu-2b preset's attention. Prints ms per forward and per
forward+backward (median of CUDA-event timings after warm-up), the attention's TFLOP/s counted as
causal (half the square), and each path's largest error against the fp32 reference on a smaller
problem; a backend that cannot run the shape says why. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention_window import time_ms  # noqa: E402

from megascope.kernels import attention  # noqa: E402


def sdpa_only(backend: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """SDPA with only `backend` enabled: fails rather than falling back, so a row is that kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def flex_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # window = seq covers every earlier token: FlexAttention's block mask is then plain causal
    return attention.flex_window_attention(q, k, v, window=q.shape[-2])


def paths() -> dict[str, Callable]:
    return {"SDPA cuDNN": sdpa_only("cudnn"), "SDPA flash (FA2)": sdpa_only("flash"),
            "SDPA memory-efficient": sdpa_only("efficient"), "FlexAttention (compiled)": flex_causal}


def max_error(fn: Callable) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 512, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = attention.attention_reference(q, k, v)
    outs = (fn(q, k, v), *torch.autograd.grad(fn(q, k, v), (q, k, v), grad))
    refs = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
    return max(float((o.float() - r.float()).abs().max() / r.float().abs().max()) for o, r in zip(outs, refs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4, help="(default: %(default)s)")
    ap.add_argument("--heads", type=int, default=20, help="(default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048, help="(default: %(default)s)")
    ap.add_argument("--head-dim", type=int, default=128, help="(default: %(default)s)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sdpa_backends: needs a CUDA device")
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v, grad = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    flops_fwd = 4 * args.batch * args.heads * args.seq ** 2 * args.head_dim / 2  # QK^T and PV, causal half
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, shape {list(shape)} bf16, causal; "
          f"torch's own order picks: {torch._fused_sdp_choice(q, k, v, is_causal=True)}")
    print(f"{'path':<26} {'fwd ms':>8} {'fwd+bwd ms':>11} {'fwd+bwd TFLOP/s':>16} {'max rel err':>12}")
    for name, fn in paths().items():
        try:
            fwd = time_ms(lambda: fn(q, k, v))
            both = time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad))
            err = max_error(fn)
        except RuntimeError as e:  # the backend does not take this shape/dtype/device
            print(f"{name:<26} not available: {str(e).splitlines()[0][:90]}")
            continue
        print(f"{name:<26} {fwd:>8.3f} {both:>11.3f} {3.5 * flops_fwd / both / 1e9:>16.1f} {err:>12.2e}")
    print("(fwd+bwd FLOPs counted as 3.5x the forward: backward recomputes QK^T, as FlashAttention does)")


if __name__ == "__main__":
    main()
