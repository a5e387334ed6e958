"""The slow stretch of each row of a rank x step matrix (the lost-time attribution's search, lost_time.py):
Kadane's contiguous stretch with the largest summed excess over a level, the level refined toward the
boundary between the slow steps and the rest, the stretch chosen by Welch's t. Every function takes all
rows at once (12,288 ranks x 1,000 steps); `max_subarray` is the one-row recurrence the vectorized one
is checked against (tests/test_lost_time_vectorized.py)."""

from __future__ import annotations

import numpy as np

REFINE_ROUNDS = 2
"""Kadane's stretch is searched again this many times, each at the level halfway between the last
stretch's median and the rest's (stretches): the first of them found test_attach_outside_spans' steps
10-59. Measured on the 25 kept fault-lab runs of 2026-11-28 22:57 (100 ranks): one search fewer moves
5 ranks' stretches, one more 2, and neither changes a finding, its steps or its cost; each costs ~0.3
CPU s at 12,288 ranks x 1,000 steps (1.7 CPU s with two, 0.6 without any)."""


def stretches(x: np.ndarray, min_steps: int, min_history: int,
              rounds: int = REFINE_ROUNDS) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x (no NaN): positions [a, b] of the stretch with the largest summed excess over the
    row's typical level. Kadane's stretch at the row's median first, then `rounds` times at the level
    halfway between the last stretch's median and the rest's (as two clusters' boundary); of those, the
    one whose mean stands out most from the rest of the row (Welch's t; the stretch >= min_steps long,
    the rest >= min_history). The median alone assumes the slow steps are a minority: measured, a 2-rank
    run slowed on steps 10-59 of 60 (test_attach_outside_spans) had its median at the fault's level,
    Kadane took steps 19-58 and t was 5.0 (< t_min 6, nothing named); at the halfway level it takes
    10-59, t 19.9. (At the rest's own level instead, every healthy step above its median joins the
    stretch.) One function for
    LostTimeDetector._stretch (one row) and its _candidates screen (all rows): the same stretches."""
    rows, n = x.shape
    y = x - np.median(x, axis=1)[:, None]  # centred: the sums of squares below lose less to cancellation
    y2 = y * y
    totals = (y.sum(axis=1), y2.sum(axis=1))
    level = np.zeros(rows)
    best_a = best_b = np.zeros(rows, int)
    best_t = np.full(rows, -np.inf)
    for r in range(rounds + 1):
        a, b = max_subarrays(y, level)
        inside = (stretch_sums(y, a, b), stretch_sums(y2, a, b))
        t = welch_t(inside, totals, b - a + 1, n, min_steps, min_history)
        better = t > best_t
        best_a, best_b, best_t = np.where(better, a, best_a), np.where(better, b, best_b), np.where(better, t, best_t)
        if r < rounds:
            level = midlevel(y, a, b, level)
    return best_a, best_b


def stretch_sums(y: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: the sum of y over [a, b], one reduceat over the flat matrix (the last row's stretch may
    end the matrix: its start alone then sums to the end)."""
    n = y.shape[1]
    base = np.arange(len(y)) * n
    at = np.stack([base + a, base + b + 1], axis=1).ravel()
    if at[-1] == y.size:
        at = at[:-1]
    return np.add.reduceat(y.ravel(), at)[0::2]


def welch_t(inside: tuple[np.ndarray, np.ndarray], totals: tuple[np.ndarray, np.ndarray], n_in: np.ndarray,
             n: int, min_steps: int, min_history: int) -> np.ndarray:
    """Per row: Welch's t of the mean inside a stretch of n_in of the row's n values against the mean of
    the rest, from the sums of values and squares inside and in all; -inf where the stretch is shorter
    than min_steps or the rest than min_history (not a candidate)."""
    n_in = n_in.astype(float)
    n_out = n - n_in
    sized = (n_in >= max(min_steps, 2)) & (n_out >= max(min_history, 2))
    n_in, n_out = np.maximum(n_in, 2), np.maximum(n_out, 2)
    (s1_in, s2_in), (t1, t2) = inside, totals
    s1_out, s2_out = t1 - s1_in, t2 - s2_in
    v_in = np.clip(s2_in - s1_in ** 2 / n_in, 0, None) / (n_in - 1)
    v_out = np.clip(s2_out - s1_out ** 2 / n_out, 0, None) / (n_out - 1)
    se = np.sqrt(v_in / n_in + v_out / n_out)
    t = (s1_in / n_in - s1_out / n_out) / np.where(se > 0, se, 1e-12)
    return np.where(sized, t, -np.inf)


def midlevel(y: np.ndarray, a: np.ndarray, b: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Per row: halfway between the median of y over [a, b] and the median of the rest (np.median's
    values: the middle one, or the middle pair's (lo + hi) / 2); `keep` where nothing is outside."""
    n = y.shape[1]
    col = np.arange(n)[None, :]
    inside = (col >= a[:, None]) & (col <= b[:, None])
    n_in = b - a + 1
    return np.where(n_in == n, keep, (masked_median(y, ~inside, n_in) + masked_median(y, inside, n - n_in)) / 2)


def masked_median(y: np.ndarray, hide: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per row: the median of the `count` values of y not hidden (count >= 1; any value where 0), by one
    sort with the hidden ones pushed to the end."""
    srt = np.sort(np.where(hide, np.inf, y), axis=1)
    at = np.arange(len(y))
    lo, hi = srt[at, np.maximum(count - 1, 0) // 2], srt[at, np.maximum(count, 1) // 2]
    return np.where(count % 2 == 1, lo, (lo + hi) / 2)


def max_subarray(x: np.ndarray) -> tuple[int, int]:
    """Positions [a, b] of the contiguous stretch with the largest sum (Kadane)."""
    best, best_a, best_b, cur, cur_a = -np.inf, 0, 0, 0.0, 0
    for i, v in enumerate(x):
        if cur <= 0:
            cur, cur_a = float(v), i
        else:
            cur += float(v)
        if cur > best:
            best, best_a, best_b = cur, cur_a, i
    return best_a, best_b


def max_subarrays(x: np.ndarray, level: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """max_subarray of each row of x (less the row's `level`, when given), the recurrence stepped for all
    rows at once (the level subtracted a column at a time: no second matrix)."""
    best = np.full(len(x), -np.inf)
    cur = np.zeros(len(x))
    cur_a, best_a, best_b = (np.zeros(len(x), int) for _ in range(3))
    for i in range(x.shape[1]):
        v = x[:, i] if level is None else x[:, i] - level
        restart = cur <= 0
        cur = np.where(restart, v, cur + v)
        cur_a = np.where(restart, i, cur_a)
        better = cur > best
        best = np.where(better, cur, best)
        best_a = np.where(better, cur_a, best_a)
        best_b = np.where(better, i, best_b)
    return best_a, best_b
