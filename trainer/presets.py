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
    # seq 2048, a GPT-2-sized vocabulary, bf16, blocks compiled. 69.6 GB peak was measured at
    # micro_batch 2 with separate master/gradient copies (16 GB, since removed for one-chunk ranks);
    # micro_batch 4 (larger GEMMs) should fit in ~65 GB: not yet measured. 32 sequences (65k tokens)
    # a step: the optimizer pass (~2% of a 16-sequence step) is paid once per 8 micro-batches, still
    # far below the ~1M-token batches models of this size train with (GPT-3 2.7B).
    "gpu-2b": {
        "model": {"n_layers": 24, "hidden": 2560, "n_heads": 20, "seq_len": 2048, "vocab_size": 50304},
        "train": {"global_batch": 32, "micro_batch": 4, "lr": 2e-4, "min_lr": 2e-5,
                  "warmup_steps": 50, "dtype": "bf16", "device": "cuda", "compile": True},
    },
}


def preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise KeyError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
