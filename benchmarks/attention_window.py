"""Sliding-window attention on one GPU: FlexAttention (forward and backward) against our Triton forward
and SDPA, bf16, side by side.

    python benchmarks/attention_window.py [--batch 4] [--heads 16] [--seq 4096] [--head-dim 128] [--windows 512,1024]

Prints one table (ms per call, median of CUDA-event timings after warm-up, fresh random inputs) and
each path's error against the fp32 reference on a smaller problem. Needs CUDA (and triton).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascope.kernels import attention  # noqa: E402


def time_ms(fn: Callable[[], object], warmup: int = 5, reps: int = 20) -> float:
    """Median ms of `fn` timed with CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def paths(window: int) -> dict[str, tuple[Callable, Callable | None]]:
    """name -> (forward, forward+backward or None)."""
    sdpa = lambda q, k, v: attention.sdpa_attention(q, k, v, window)  # noqa: E731
    flex = lambda q, k, v: attention.flex_window_attention(q, k, v, window)  # noqa: E731
    triton = lambda q, k, v: attention.flash_attention(q, k, v, window)  # noqa: E731
    return {"SDPA + boolean mask": (sdpa, sdpa), "FlexAttention (compiled)": (flex, flex),
            "Triton forward (+ SDPA-recompute backward)": (triton, triton)}


def fwd_bwd(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> Callable:
    def run() -> None:
        torch.autograd.grad(fn(q, k, v), (q, k, v), grad)
    return run


def errors(window: int) -> dict[str, float]:
    """max |path - reference| / max |reference| of the output and the three gradients, [2, 4, 1024, 64]."""
    g = torch.Generator().manual_seed(window)
    q, k, v, grad = (torch.randn(2, 4, 1024, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = attention.attention_reference(q, k, v, window)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = {}
    for name, (fn, _) in paths(window).items():
        got = fn(q, k, v)
        got_grads = torch.autograd.grad(got, (q, k, v), grad)
        out[name] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                        for a, b in zip((got, *got_grads), (ref, *ref_grads)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--windows", default="512,1024", help="comma-separated window sizes")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_window: needs a CUDA GPU (torch sees none)")
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 {list(shape)}")
    print("| window | path | forward (ms) | forward + backward (ms) | max rel. error vs fp32 |")
    print("|---:|---|---:|---:|---:|")
    causal = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    full = lambda q, k, v: attention.sdpa_attention(q, k, v, 0)  # noqa: E731
    print(f"| full causal | SDPA (flash) | {time_ms(lambda: full(*causal[:3])):.3f} | "
          f"{time_ms(fwd_bwd(full, *causal)):.3f} | |")
    for window in (int(w) for w in args.windows.split(",")):
        err = errors(window)
        q, k, v, grad = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                         for _ in range(4))
        for name, (fn, trained) in paths(window).items():
            with torch.no_grad():
                forward = time_ms(lambda: fn(q, k, v))
            both = time_ms(fwd_bwd(trained, q, k, v, grad.detach())) if trained is not None else float("nan")
            print(f"| {window} | {name} | {forward:.3f} | {both:.3f} | {err[name]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
