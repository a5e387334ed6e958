"""Named presets: partial config trees applied over the defaults, before --config and flags."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds per step on 2 CPU cores; the demo and most tests use it.
    "tiny": {
        "model": {"n_layers": 4, "hidden": 64, "n_heads": 4, "seq_len": 64},
        "train": {"global_batch": 16, "micro_batch": 4, "lr": 3e-3, "warmup_steps": 10},
    },
    # A few minutes on a laptop CPU; useful for overhead and bubble measurements.
    "small": {
        "model": {"n_layers": 8, "hidden": 256, "n_heads": 8, "seq_len": 128},
        "train": {"global_batch": 32, "micro_batch": 4, "lr": 1e-3, "warmup_steps": 20},
    },
    # GPT-style 350M-class shape for one GPU node (bf16).
    "gpu": {
        "model": {"n_layers": 24, "hidden": 1024, "n_heads": 16, "seq_len": 2048, "vocab_size": 256},
        "train": {"global_batch": 64, "micro_batch": 4, "lr": 3e-4, "min_lr": 3e-5,
                  "warmup_steps": 50, "dtype": "bf16", "device": "cuda"},
    },
    # A ~2B-parameter GPT for one 80 GB GPU (H100/H200), sized for MFU: hidden 2560 (head_dim 128),
    # seq 2048, a GPT-2-sized vocabulary, bf16, blocks compiled. Micro-batches of 4 (larger GEMMs) took
    # 52.3 ms of forward and backward per sequence on an H100, 58.7 at 2 (an earlier round, another
    # machine of the same kind), and peaked at 66.6 GB (NVML).
    # 32 sequences (65k tokens) a step: the fused optimizer pass (43 ms) is paid once per 8
    # micro-batches, still far below the ~1M-token batches models of this size train with (GPT-3 2.7B).
    # Measured: 53.0% MFU on one H100, 55.5% on one H200 (README "GPU").
    "gpu-2b": {
        "model": {"n_layers": 24, "hidden": 2560, "n_heads": 20, "seq_len": 2048, "vocab_size": 50304},
        "train": {"global_batch": 32, "micro_batch": 4, "lr": 2e-4, "min_lr": 2e-5,
                  "warmup_steps": 50, "dtype": "bf16", "device": "cuda", "compile": True,
                  # H100, GPU round 3: 52.0% -> 53.0% MFU (step 1.733 -> 1.702 s) with the compiled loss
                  "compile_loss": True},
    },
}

# The same model for a 141 GB card (H200): micro-batches of 8 (larger GEMMs; 83 GB peak, past an 80 GB
# H100) and 64 sequences a step (the optimizer paid once per 8 micro-batches). H200, GPU round 4: gpu-2b
# 55.5% MFU, micro-batches of 8 58.0%, and 64 sequences 58.6% (README "GPU").
PRESETS["gpu-2b-141g"] = {"model": PRESETS["gpu-2b"]["model"],
                          "train": {**PRESETS["gpu-2b"]["train"], "global_batch": 64, "micro_batch": 8}}


def preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise KeyError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
