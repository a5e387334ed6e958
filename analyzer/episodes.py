"""Episodes: runs of flagged steps in a per-step series (persistence, onset, on/off patterns)."""

from __future__ import annotations

from collections.abc import Iterable


def runs(steps: Iterable[int], max_gap: int = 1) -> list[tuple[int, int, int]]:
    """Group sorted flagged steps into (first, last, count) runs; steps at most `max_gap` apart join."""
    out: list[tuple[int, int, int]] = []
    for s in sorted(set(int(x) for x in steps)):
        if out and s - out[-1][1] <= max_gap:
            first, _, n = out[-1]
            out[-1] = (first, s, n + 1)
        else:
            out.append((s, s, 1))
    return out


def persistent_runs(steps: Iterable[int], min_len: int, max_gap: int = 1) -> list[tuple[int, int, int]]:
    """Runs holding at least `min_len` flagged steps: a one-off spike is noise, a run is a fault."""
    return [r for r in runs(steps, max_gap) if r[2] >= min_len]
