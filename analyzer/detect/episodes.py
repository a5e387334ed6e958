"""Episodes: runs of flagged steps in a per-step series (persistence, onset, on/off patterns), and
how likely a stretch of them is by chance."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


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


def has_persistent_runs(flags: np.ndarray, min_len: int, max_gap: int = 1) -> np.ndarray:
    """Per row of a (rows, positions) bool matrix: whether persistent_runs of its flagged positions finds
    a run, every row at once from the flagged cells in row order (a run breaks at a new row or a gap over
    `max_gap`), with no Python step per row or position."""
    r, c = np.nonzero(flags)
    found = np.zeros(len(flags), dtype=bool)
    if not len(r):
        return found
    new = np.ones(len(r), dtype=bool)
    new[1:] = (r[1:] != r[:-1]) | (c[1:] - c[:-1] > max_gap)
    starts = np.flatnonzero(new)
    lengths = np.diff(np.append(starts, len(r)))
    found[r[starts[lengths >= min_len]]] = True
    return found


def binomial_tail(k: int, n: int, q: float) -> float:
    """P(X >= k) for X ~ Binomial(n, q): how likely k or more flagged steps out of n are by chance
    when each step is flagged at the run's own rate q (no distribution assumed for the scores
    themselves, so heavy-tailed noise is judged by how often it really crosses the threshold)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    q = min(max(q, 1e-12), 1 - 1e-12)
    logs = [math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * math.log(q)
            + (n - j) * math.log1p(-q) for j in range(k, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def cusum_stretches(z: Sequence[float], drift: float, clip: float, h: float) -> list[tuple[int, int]]:
    """Index ranges [start, end] of upward shifts in a series of z-scores: the one-sided CUSUM
    S_t = max(0, S_t-1 + min(z_t, clip) - drift) rises above `h`; the stretch starts after S's last
    zero before that and ends where S peaks (it falls once the shift ends). Each step adds at most
    clip - drift, so a few outliers cannot raise an alarm on their own."""
    out: list[tuple[int, int]] = []
    s, start, peak, peak_at, alarmed = 0.0, 0, 0.0, -1, False
    for i, value in enumerate(z):
        s = max(0.0, s + min(float(value), clip) - drift)
        if s > peak:
            peak, peak_at = s, i
        if s >= h:
            alarmed = True
        if s == 0.0:
            if alarmed:
                out.append((start, peak_at))
            s, start, peak, peak_at, alarmed = 0.0, i + 1, 0.0, -1, False
    if alarmed:
        out.append((start, peak_at))
    return out


def cusum_stretches_rows(z: np.ndarray, drift: float, clip: float, h: float) -> list[list[tuple[int, int]]]:
    """cusum_stretches of each row of a (series, steps) array, all rows at once (one numpy step per
    column instead of a Python step per value: 12,288 ranks x 1,000 steps took ~10 s one by one)."""
    n_rows, n = z.shape
    out: list[list[tuple[int, int]]] = [[] for _ in range(n_rows)]
    s, peak = np.zeros(n_rows), np.zeros(n_rows)
    start, peak_at = np.zeros(n_rows, dtype=np.int64), np.full(n_rows, -1, dtype=np.int64)
    alarmed = np.zeros(n_rows, dtype=bool)
    for i in range(n):
        s = np.maximum(0.0, s + np.minimum(z[:, i], clip) - drift)
        up = s > peak
        peak[up], peak_at[up] = s[up], i
        alarmed |= s >= h
        zero = s == 0.0
        if zero.any():
            for r in np.flatnonzero(zero & alarmed):
                out[r].append((int(start[r]), int(peak_at[r])))
            start[zero], peak[zero], peak_at[zero], alarmed[zero] = i + 1, 0.0, -1, False
    for r in np.flatnonzero(alarmed):
        out[r].append((int(start[r]), int(peak_at[r])))
    return out


def change_point(z: np.ndarray, a: int, b: int, min_steps: int, clip: float = 3.0) -> int:
    """Where in z[:b+1] (scores in sigma) the level shifted, near a CUSUM stretch starting at `a`: the
    split k maximizing (mean after - mean before) x sqrt(k (n - k) / n) of the clipped scores, the
    classic two-sample change-point statistic (means, not medians: a median ignores the shifted
    steps a split leaves on the wrong side until half are, so the sqrt term dragged the onset toward
    the middle; held-out generator case: 338 for 300). The CUSUM's own start can drift early when the
    rank sat a little above 0 before (a real run: 164 steps early)."""
    n = b + 1
    lo, hi = max(min_steps, a - (b - a) // 2), min(n - min_steps, a + (b - a) // 2)
    if lo >= hi:
        return a
    zc = np.clip(z[:n], -clip, clip)
    csum = np.concatenate(([0.0], np.cumsum(zc)))
    ks = np.arange(lo, hi + 1)
    before, after = csum[ks] / ks, (csum[n] - csum[ks]) / (n - ks)
    return int(ks[int(np.argmax((after - before) * np.sqrt(ks * (n - ks) / n)))])
