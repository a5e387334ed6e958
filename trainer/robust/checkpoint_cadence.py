"""When the training loop checkpoints: every n steps, never, or every `checkpoint_interval_s` of training.

A checkpoint is collective (rank 0 publishes it once every writer's shard is in place), so every rank
must save after the same step. A time cadence cannot let each rank read its own clock; instead every
rank times PROBE_STEPS steps (after the first of the attempt, which pays for warm-up), the ranks agree
on the slowest median with one all-reduce, and the interval becomes a step count from then on. Runs
shorter than the probe (most tests) never reach the all-reduce and write no checkpoint.
"""

from __future__ import annotations

import statistics
from typing import Callable

from megascope.trainer.config import RobustConfig

PROBE_STEPS = 5
"""Steps timed before a time cadence is turned into a step count (after the attempt's first step)."""


def steps_for_interval(interval_s: float, step_s: float) -> int:
    """Steps between checkpoints so that they are about interval_s apart (at least 1)."""
    return max(1, round(interval_s / step_s)) if step_s > 0 else 1


class CheckpointCadence:
    """`due(step, step_s)` after each step says whether to checkpoint; with a time cadence it calls
    `agree(median_step_s) -> slowest rank's median` once, on every rank after the same step."""

    def __init__(self, robust: RobustConfig, start_step: int, agree: Callable[[float], float]) -> None:
        self.every = robust.checkpoint_every
        """Steps between checkpoints; 0 = never; -1 = not known yet (time cadence, still probing)."""
        self.interval_s = robust.checkpoint_interval_s
        self.start_step = start_step
        self.agree = agree
        self.step_s: float | None = None
        """The agreed step time, once a time cadence has been fixed ..."""
        self.fixed_at: int | None = None
        """... after this step."""
        self._times: list[float] = []

    def due(self, step: int, step_s: float) -> bool:
        if self.every < 0 and step > self.start_step:
            self._times.append(step_s)
            if len(self._times) == PROBE_STEPS:
                self.step_s = self.agree(statistics.median(self._times))
                self.every = steps_for_interval(self.interval_s, self.step_s)
                self.fixed_at = step
        return self.every > 0 and (step + 1) % self.every == 0

    def describe(self) -> str:
        return (f"checkpoints every {self.every} steps (~{self.interval_s:g} s at {self.step_s:.3g} s per step, "
                "the slowest rank's median)")


def agree_max(group, device) -> Callable[[float], float]:
    """The slowest rank's value, by an all-reduce over `group` (plain torch.distributed: untraced)."""
    def agree(value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    return agree
