"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr. Pure function of the step."""

from __future__ import annotations

import math

from megascope.trainer.config import TrainConfig


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
