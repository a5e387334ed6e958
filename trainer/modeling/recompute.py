"""Activation recomputation (Korthikanti et al., "Reducing Activation Recomputation", 2022).

- none:      keep every activation for backward.
- selective: recompute only the attention core (softmax(QK^T)V): it holds the O(s^2) activations but
             costs few FLOPs to redo, so it saves most of the memory for ~2-4% extra compute.
- full:      keep only each block's input and rerun the whole block in backward (one extra forward,
             Megatron's 96 B s l h^2 hardware-FLOP count; see trainer/modeling/flops.py).

Implemented with torch.utils.checkpoint (non-reentrant) by wrapping the target module's `forward` on
the instance, so parameter names, optimizer buckets and hooks are unchanged. The tensor-parallel
collectives inside a block are rerun in backward under full recomputation, in the same order on
every tp rank, exactly as Megatron does.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megascope.trainer.config import RECOMPUTE_MODES
from megascope.trainer.modeling.model import Block

MODES = RECOMPUTE_MODES  # parallel.recompute's choices (config.Recompute)


def apply_recompute(chunks: Sequence[nn.Module], mode: str) -> int:
    """Make the blocks of every chunk recompute per `mode`; returns how many modules were wrapped."""
    if mode not in MODES:
        raise ValueError(f"recompute '{mode}' unknown; use one of: {', '.join(MODES)}")
    if mode == "none":
        return 0
    wrapped = 0
    for chunk in chunks:
        for block in _blocks(chunk):
            target = block if mode == "full" else block.attention_core
            _checkpoint_forward(target)
            wrapped += 1
    return wrapped


def _blocks(chunk: nn.Module) -> list[Block]:
    blocks = getattr(chunk, "blocks", None)
    if blocks is None:
        raise TypeError(f"{type(chunk).__name__} has no `blocks`; recomputation wraps transformer blocks")
    return list(blocks)


def _checkpoint_forward(module: nn.Module) -> None:
    if getattr(module, "_recomputed", False):
        return  # wrapping twice would recompute twice
    inner: Callable[..., torch.Tensor] = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    setattr(module, "_recomputed", True)  # a marker on the module instance (nn.Module declares none)
