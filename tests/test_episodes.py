"""The stretch statistics of analyzer/detect/episodes.py: the binomial chance of a stretch of flagged steps
and the CUSUM that proposes sustained stretches, with the change point that places their onset."""

from __future__ import annotations

import itertools
import math

import numpy as np

from megascope.analyzer.detect.episodes import (
    binomial_tail,
    change_point,
    cusum_stretches,
    has_persistent_runs,
    persistent_runs,
)


def test_binomial_tail_matches_enumeration():
    for n, q in [(1, 0.3), (5, 0.05), (8, 0.5), (12, 0.16)]:
        for k in range(n + 2):
            exact = sum(q ** sum(bits) * (1 - q) ** (n - sum(bits))
                        for bits in itertools.product((0, 1), repeat=n) if sum(bits) >= k)
            assert math.isclose(binomial_tail(k, n, q), exact, rel_tol=1e-9, abs_tol=1e-15), (k, n, q)


def test_binomial_tail_is_finite_for_long_stretches():
    # 756 of 990 steps at a 17% rate: far below any float, not NaN or an overflow
    p = binomial_tail(756, 990, 0.17)
    assert 0.0 <= p < 1e-200
    assert binomial_tail(0, 990, 0.17) == 1.0


def test_cusum_finds_a_sustained_shift_and_ignores_outliers():
    rng = np.random.default_rng(0)
    z = rng.normal(0.0, 1.0, 1000)
    z[[100, 101, 300, 700]] = 25.0          # lone outliers: each adds at most clip - drift
    z[450:] += 1.74                          # a 1.74 sigma shift from step 450
    stretches = cusum_stretches(z, drift=0.75, clip=3.0, h=10.0)
    assert len(stretches) == 1
    start, end = stretches[0]
    assert 440 <= start <= 460 and end >= 990


def test_cusum_on_noise_alone_stays_quiet():
    rng = np.random.default_rng(1)
    assert cusum_stretches(rng.normal(0.0, 1.0, 5000), drift=0.75, clip=3.0, h=10.0) == []


def test_change_point_finds_the_onset_not_the_middle():
    rng = np.random.default_rng(2)
    z = rng.standard_t(3, 1000)              # heavy-tailed noise
    z[300:] += 1.5
    (a, b), = cusum_stretches(z, drift=0.25, clip=3.0, h=10.0)
    assert abs(change_point(z, a, b, 20) - 300) <= 8


def test_a_gross_stretch_in_a_short_noisy_run_is_not_chance():
    # 6 steps of a rank 30x slower than its peers, in a run whose peers cross the flag threshold on a
    # third of their steps: the flag rate alone calls it chance (0.33^6 x 24 = 0.03 > 0.01); at the gross
    # level (2x), which the peers reach on 2% of steps, it is not
    import pandas as pd

    from megascope.analyzer.detect.stragglers import StragglerDetector

    det = StragglerDetector()
    det._trials = 24
    rows = pd.DataFrame({"step": range(4, 10), "x": [3.4] * 6})
    flag_all = pd.Series([True] * 6)
    args = (rows, rows.x, 0.69, flag_all, 0.3, 3, 3)
    assert det.stretch(*args, null_rate=0.33) is None
    ep = det.stretch(*args, null_rate=0.33, gross_rate=0.02)
    assert ep is not None and (ep.first, ep.last) == (4, 9)
    # a noise stretch just over the flag threshold stays chance at both levels
    noisy = rows.assign(x=[0.8, 0.75, 0.9, 0.7, 0.85, 0.8])
    assert det.stretch(noisy, noisy.x, 0.69, flag_all, 0.3, 3, 3, null_rate=0.33, gross_rate=0.02) is None


def test_persistent_runs_of_every_row_at_once():
    """has_persistent_runs (the straggler detector's screen of its candidates) against persistent_runs
    row by row: gaps at and over max_gap, runs at the row's ends, empty rows."""
    rng = np.random.default_rng(0)
    for density in (0.05, 0.3, 0.7):
        flags = rng.random((60, 40)) < density
        flags[3] = False
        flags[4] = True
        for min_len, max_gap in itertools.product((0, 1, 3, 5), (0, 1, 2, 4)):
            want = [bool(persistent_runs(np.flatnonzero(row), min_len, max_gap)) for row in flags]
            assert has_persistent_runs(flags, min_len, max_gap).tolist() == want
