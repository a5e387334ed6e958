"""What gets recorded: a pure per-step schedule and the trace level.

    schedule(step) -> bool     True: record this step's spans (the steps table is always written)
    level                      step: steps table only; op: compute, collectives, p2p, host spans;
                               detail: also spans marked level="detail" (e.g. per-layer ops)

The schedule is a pure function of the step, so every rank records the same steps and the analyzer
can match a collective across ranks in any recorded step.
"""

from __future__ import annotations

from typing import Callable, Literal, get_args

TraceLevel = Literal["step", "op", "detail"]
LEVELS: tuple[TraceLevel, ...] = get_args(TraceLevel)

Schedule = Callable[[int], bool]


def every_n_steps(every: int) -> Schedule:
    """Record steps 0, n, 2n, ... (every=1: all steps)."""
    if every < 1:
        raise ValueError(f"trace.every must be >= 1 (1 = record every step), got {every}")
    if every == 1:
        return lambda step: True
    return lambda step: step % every == 0


def check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"trace.level must be one of {', '.join(LEVELS)}, got {level!r}")
    return level
