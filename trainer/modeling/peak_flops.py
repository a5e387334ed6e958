"""Peak FLOP/s of one device, the denominator of MFU, and where the number came from.

GPUs: the vendor's dense bf16 tensor-core peak from a table. CPUs have no such number, so a short GEMM
benchmark measures one at start-up; run.json records which it was.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s, from NVIDIA's data sheets.
GPU_PEAK_BF16: dict[str, float] = {
    "A100": 312e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "H20": 148e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,
}


@dataclass(frozen=True)
class PeakFlops:
    per_device: float
    """FLOP/s of one device (one GPU, or the CPU share of one rank)."""
    source: str
    """'table:<entry>' or 'measured:gemm <n>x<n> fp32, <threads> threads'."""
    device: str

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_peak(name: str) -> PeakFlops | None:
    """Longest table entry contained in the CUDA device name (so 'H100 NVL' wins over 'H100')."""
    matches = [k for k in GPU_PEAK_BF16 if k.lower() in name.lower()]
    if not matches:
        return None
    key = max(matches, key=len)
    return PeakFlops(GPU_PEAK_BF16[key], f"table:{key} bf16 dense", name)


def measure_cpu_peak(threads: int, n: int = 512, seconds: float = 0.5) -> PeakFlops:
    """Best fp32 GEMM rate over repeated n x n matmuls with `threads` intra-op threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm-up: allocations and thread-pool start
        best = 0.0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(previous)
    return PeakFlops(best, f"measured:gemm {n}x{n} fp32, {threads} threads", "cpu")


def detect_peak(device: torch.device, cpu_threads: int) -> PeakFlops:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = gpu_peak(name)
        if found is not None:
            return found
        # Unknown GPU: measure instead of guessing (bf16 GEMM).
        n = 4096
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        torch.mm(a, a)
        torch.cuda.synchronize(device)  # note: CPU-GPU sync point, start-up only
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(a, a)
        torch.cuda.synchronize(device)  # note: CPU-GPU sync point, start-up only
        rate = 10 * 2 * n**3 / (time.perf_counter() - t0)
        return PeakFlops(rate, f"measured:gemm {n}x{n} bf16", name)
    return measure_cpu_peak(cpu_threads)
