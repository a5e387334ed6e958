"""Stragglers, late launches and stage imbalance: each rank judged against the ranks doing the same
work (peer_stats.py: stage peers without the rank itself, log-scale scores, the run's own noise),
with persistence over steps, the rank's own history before the onset, and an onset step.

- slow compute (straggler): own forward+backward time (waits nested in compute removed, so victims
  are not blamed) scores >= max(log `min_ratio`, `z_flag` sigma) and costs >= `min_excess_frac` of
  the step, on `persist_steps` steps (a spike is noise). The rank's forward is slower too (a slow
  chip slows every kernel). Before the onset it must have been like its peers (`z_shift` sigma
  lower); a rank slow from the first analyzed step needs `z_start` sigma (scheduler asymmetries on
  an oversubscribed host are persistent but small). The stretch's flagged steps must be unlikely by
  chance at the run's own flag rate (`chance_alpha`: heavy tails, long runs). A smaller shift held for
  long (heavy per-step noise) is found by a CUSUM stretch and the same chance test at 1 sigma
  (`_sustained`). A slowdown the replica's other stages share at the same steps is its work, not the
  rank (`replica_share`); a tp/cp block slow together is one finding (merge_tp_groups).
- late launch: the rank's own time (compute + data wait + host gaps) is high while its forward is
  normal: it is slow to issue its collectives (GC pauses, sleeps before the launch), on
  >= `late_min_count` steps spaced <= `late_max_period` apart. Arrival skew at the collectives is
  attached as evidence (the culprit arrives last; its peers wait: victims).
- stage imbalance: ALL ranks of a stage are slower than the other stages (the stage's low quartile
  rank, not its median: one straggler among two ranks is not an imbalance).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import pandas as pd

from megascope.analyzer.data.store import Store
from megascope.analyzer.detect.context import DetectContext
from megascope.analyzer.detect.episodes import (
    binomial_tail,
    change_point,
    cusum_stretches,
    cusum_stretches_rows,
    has_persistent_runs,
    persistent_runs,
)
from megascope.analyzer.detect.finding_merge import merge_hosts, merge_tp_groups
from megascope.analyzer.detect.peer_stats import (
    PEER_GRID_COLUMNS,
    ScoreGrid,
    loo_median_rows,
    median_inplace,
    noise_sigma,
    noise_sigma_grid,
    rank_step_scores,
)
from megascope.analyzer.findings import Finding, hosts_of
from megascope.analyzer.settings import StragglerConfig

ONSET_SHARE = 0.6
"""The onset is the first step of the stretch past this share of the level shift: a step only partly
slowed, or a noisy one just before, is not yet the new level (the error is late by a step at most)."""


DATA_WORK_SHARE = 0.25
"""Late launches: the share of the own-time excess (log ratio) the rank's compute must carry before its
replica's compute can explain it as data. Measured on the independent generator (no p2p rows): sequence
lengths AR(1) rho 0.8, dp32 x pp2 x cp2, seed 0, replica 12's four ranks late launches beside the workload
imbalance on steps 0-7: own-time level 0.24, own compute 0.11 (46%), the other stage's compute 0.11; an
untraced 20 ms host pause on one rank of dp4 x pp4 and the ranks waiting on it: own compute <= 2% of
their level (issue 31, item 5)."""


@dataclass
class Episode:
    first: int
    last: int
    level: float
    """Median score (log ratio vs peers) over the flagged steps."""
    rows: pd.DataFrame
    """The flagged rank-steps between first and last."""
    runs: list[tuple[int, int, int]]


class StragglerDetector:
    """A default detector (Run: `detect(ctx)`; diagnose.py)."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.cfg = config or StragglerConfig()

    def detect(self, ctx: DetectContext) -> list[Finding]:
        store = ctx.store
        grid = rank_step_scores(store, ctx.warmup_factor)
        if grid is None:
            return []
        ctx.peer_grid = grid.part(PEER_GRID_COLUMNS)  # for the workload imbalance detector
        self._trials = max(1, len(grid.ranks) * len(grid.steps))
        sigma = noise_sigma_grid(grid, grid["x_work_s"])
        slow = self._slow_compute(store, grid, sigma)
        late = self._late_launch(store, grid, sigma, {f.ranks[0] for f in slow})
        findings = merge_tp_groups(merge_hosts(slow + late, store.topology), grid.members())
        return findings + self._imbalance(store, grid, sigma)

    def null_rate(self, grid: ScoreGrid, flag: np.ndarray) -> np.ndarray:
        """Per rank (grid row): the run's own rate of flagged rank-steps among the OTHER ranks, the median
        of their per-rank rates (peer_stats.loo_median_rows' rule: exact up to 16 ranks, the plain
        median beyond, where one rank does not move it). A median that counts the rank judged is no
        null: with two ranks per run (dp=2) it is the mean of culprit and victim, and a real dp2 run with
        rank 1 2.0-2.4x slower on steps 4-9 of 10 was dismissed as chance (its 6 flags put the pooled
        rate at 0.35, 0.35^6 x 20 rank-steps = 0.04; the victim's own rate, 0.1: 2e-5)."""
        per_rank = grid.per_rank_mean(flag)[:, None]
        others = loo_median_rows(per_rank, np.ones(per_rank.shape, dtype=bool), [np.arange(len(per_rank))])[:, 0]
        # a lone rank has no others (no peers, no scores either): its own rate
        rate = np.where(np.isnan(others), per_rank[:, 0], others)
        # a rate measured on n rank-steps resolves no finer than 1/n: no flag among the other rank's 9
        # steps is no evidence of a rate below 1/9 (a real clean dp2 run under 60% foreign CPU load gave
        # its rank 1 3 flagged own-time steps right after warm-up: at the floor of 1% they were a late
        # launch, 0.01^3 x 18; at 1/9, 0.025: chance). Runs of >= 100 rank-steps are not moved by it.
        n_steps = grid.present.sum(axis=1)
        n_others = np.maximum(1, n_steps.sum() - n_steps)
        return np.maximum(np.maximum(self.cfg.min_null_rate, 1.0 / n_others), rate)

    def rank_rate(self, grid: ScoreGrid, rates: np.ndarray, rank: int) -> float:
        """The null_rate of `rank` (its grid row)."""
        return float(rates[int(np.searchsorted(grid.ranks, rank))])

    def by_chance(self, k: int, n: int, rate: float, lengths: int = 1) -> bool:
        """Could k flagged steps among n arise by chance somewhere in this run (cfg.chance_alpha)? The
        trials are the run's rank-steps (where a stretch can start) times `lengths`, the stretch lengths
        it could have been cut to from the same start."""
        return binomial_tail(k, n, rate) * getattr(self, "_trials", 1) * lengths > self.cfg.chance_alpha

    def episode(self, rows: pd.DataFrame, measure: str, sigma: float, max_gap: int, min_count: int,
                z_flag: float | None = None, null_rate: float | None = None,
                gross_rate: float | None = None) -> Episode | None:
        """The persistent stretch where the rank's `measure` (log-ratio score x_<measure>) stands out
        from its peers by >= max(log min_ratio, z_flag sigma) and >= min_excess_frac of the step."""
        cfg = self.cfg
        x = rows[f"x_{measure}"]
        extra_ok = rows[measure] - rows[f"ref_{measure}"] >= cfg.min_excess_frac * rows.step_time_s
        threshold = self.flag_threshold(sigma, z_flag)
        return self.stretch(rows, x, threshold, extra_ok, sigma, max_gap, min_count, periodic=max_gap > 3,
                            null_rate=null_rate, gross_rate=gross_rate)

    def flag_threshold(self, sigma: float, z_flag: float | None = None) -> float:
        """The score a step must reach in `episode`. A rank twice as slow as its peers is flagged however
        noisy the run (the shift and persistence tests still apply): noise must not hide a gross straggler."""
        cfg = self.cfg
        return max(math.log(cfg.min_ratio), min((z_flag or cfg.z_flag) * sigma, math.log(cfg.gross_ratio)))

    def episode_flags(self, grid: ScoreGrid, rows: np.ndarray, measure: str, sigma: float,
                      z_flag: float | None = None) -> np.ndarray:
        """The flags `episode` takes (score at its threshold, extra time material) for the grid rows
        `rows`, as a (rows, steps) matrix (False where a rank has no row): the same comparisons of the
        same values as on the rank's long rows."""
        v = grid.values
        extra = v[measure][rows] - v[f"ref_{measure}"][rows]
        with np.errstate(invalid="ignore"):
            return ((v[f"x_{measure}"][rows] >= self.flag_threshold(sigma, z_flag))
                    & (extra >= self.cfg.min_excess_frac * v["step_time_s"][rows]) & grid.present[rows])

    def stretch(self, rows: pd.DataFrame, score: pd.Series, threshold: float, extra_ok: pd.Series, sigma: float,
                max_gap: int, min_count: int, periodic: bool = False, null_rate: float | None = None,
                gross_rate: float | None = None) -> Episode | None:
        """Flagged steps (score >= threshold and extra_ok), persistent runs of them, and the onset.
        null_rate / gross_rate: the run's rate of rank-steps at the flag threshold / at log(gross_ratio),
        for the chance test (none: no chance test)."""
        flag = (score >= threshold) & extra_ok
        # persistence and onsets count positions among the run's steps, not step ids: a sampled trace
        # (NDTimeline keeps one step in N: ids 16, 44, 72, ...) has no two adjacent ids, and a rank 2.35x
        # slower on every one of its 44 steps was not named (issue 31)
        pos = rows["pos"] if "pos" in rows else rows.step
        found = persistent_runs(pos[flag], min_count, max_gap=max_gap)
        if not found:
            return None
        first, last = found[0][0], found[-1][1]
        after_flag = flag if periodic else None  # every K steps: judge the flagged steps only
        onset = self._onset(pos, score, flag, first, last, sigma, int(pos.max()), after_flag)
        if onset is None or onset > last:
            return None  # (a periodic onset can fall past the last run: no flagged step would be left)
        in_stretch = pos.between(onset, last)
        flagged = rows[flag & in_stretch]
        observed = int(in_stretch.sum())
        level = float(score[flag & in_stretch].median())
        # an unflagged step still past ONSET_SHARE of the stretch's level (against its peers) has not gone
        # back: it holds the state. Measured: a real dp=4 run under CI load (tests/test_train_watch.py, a
        # 3x straggler from step 3 of 14, sigma 0.28, threshold 0.56) scored 0.50-0.55 on 4 of the 11
        # steps from its onset (the rest 0.65-1.17) and, counting flags only (7 of 11 < 0.65), was missed
        # in 1 of 27 such runs
        held = flag | (extra_ok & (score >= ONSET_SHARE * level))
        if not periodic and int((held & in_stretch).sum()) < self.cfg.min_flagged_share * observed:
            return None  # scattered flags merged across gaps back at the peers' level: not a persistent state
        # a periodic stretch is sparse (flags up to late_max_period apart), so where it ends is picked
        # from the flags after the fact among ~n lengths, each one more trial; a dense stretch is cut by
        # its run of flags. Measured (p = tail x rank-steps): the one false periodic late launch of the
        # independent suite's fresh seeds 4000-4001 (5 gap flags in 17 steps at a 1.1% rate, a 1,800-step
        # heavy-noise run) p = 0.0067, x 17 = 0.11; the true periodic ones (simulator suite) p x n <= 6e-7;
        # the independent suite's tuned and held-out seeds have no periodic stretch
        lengths = observed if periodic else 1
        if null_rate is not None and self.by_chance(len(flagged), observed, null_rate, lengths):
            # as many flags arise by chance somewhere in a run this long or this noisy, unless the stretch
            # is unlikely at the gross level too: the flag rate is blind to magnitude, and a short, noisy
            # run (a profiled window of 6 steps after warm-up, peers flagged on a third of them: chance
            # 0.33^6 x 24 rank-steps = 0.03) would dismiss a rank 30x slower than its peers on every step
            # (the likely cause of a rare miss in tests/test_import_kineto.py's profiled round trip);
            # noise stretches rarely reach 2x on most of their steps
            gross = int((score[pos.between(onset, last)] >= math.log(self.cfg.gross_ratio)).sum())
            if gross_rate is None or self.by_chance(gross, observed, gross_rate):
                return None
        step_of = dict(zip(pos.astype(int), rows.step.astype(int)))
        return Episode(step_of[int(onset)], step_of[int(last)], level, flagged,
                       [(step_of[a], step_of[b], n) for a, b, n in found if b >= onset])

    def _onset(self, steps: pd.Series, x: pd.Series, flag: pd.Series, first: int, last: int,
               sigma: float, run_last: int, after_flag: pd.Series | None = None, lookahead: int = 4,
               lookback: int = 2) -> int | None:
        """The step where the rank's level shifted: among the flagged steps up to `lookahead` after the
        first (and the `lookback` steps before it), the one with the largest shift (median after -
        median before; ties: the earliest), at least `z_shift` sigma; the onset is the first step of the
        contiguous stretch around it past ONSET_SHARE of that shift. "After" spans at least
        2 x persist_steps (or to the end of the run): a straggler is a state that lasts, a burst of
        scheduler noise is not. No history before (slow from the start): the level must reach `z_start`."""
        cfg = self.cfg
        ok = np.isfinite(x)
        shifts = {}
        candidates = flag & steps.between(first, first + lookahead)
        if after_flag is None:
            # also the `lookback` steps before the first flag: a level shift whose first steps fell just
            # under the flag threshold put them in "before", and its median no longer showed the shift (a
            # real dp=4 run under CI load, sigma 0.50: a 3x straggler from step 3 scored 0.55, 0.69 on
            # steps 2-3, flags began at 4, the best split shifted 0.62 < 0.65 = 1.3 sigma and it was missed;
            # split at 2 the shift is 0.87)
            candidates |= steps.between(first - lookback, first - 1)
        for k in sorted(set(steps[candidates].astype(int))):
            before = x[ok & (steps < k)]
            after = x[ok & steps.between(k, max(last, min(k + 2 * cfg.persist_steps - 1, run_last)))
                      & (after_flag if after_flag is not None else True)]
            if len(before) >= 2 and len(after) >= cfg.persist_steps:
                shifts[k] = float(after.median()) - float(before.median())
        if shifts and max(shifts.values()) >= cfg.z_shift * sigma:
            # the earliest split within one sigma of the largest shift: on an intermittent fault (a
            # host pausing on 80% of steps) a later split gains a little by leaving an off step out
            # of "after" (independent generator: onset 25 for 20), a noise-sized gain
            top = max(shifts.values())
            best = min(k for k in shifts if shifts[k] >= top - sigma)
            # the stretch around the best split already at the new level (past ONSET_SHARE of the shift)
            level = float(x[ok & (steps < best)].median()) + ONSET_SHARE * shifts[best]
            high = sorted(int(k) for k in steps[ok & (x >= level) & (flag if after_flag is not None else True)])
            step_gap = self.cfg.late_max_period if after_flag is not None else 1
            # a lone step at the new level followed by one back at the old is a spike, not the onset
            flagged = set(int(k) for k in steps[flag & ok])
            later = [k for k in high if k >= best and (step_gap > 1 or k + 1 in flagged or k == int(steps.max()))]
            if not later:
                return best
            onset = later[0]
            for k in reversed([k for k in high if k < onset]):  # back over the stretch at the new level
                if onset - k > step_gap:
                    break
                onset = k
            if int((ok & (steps < onset)).sum()) >= 2:
                return onset
            # the stretch reached back into the steps that made its history: < 2 are left before the
            # onset, so the rank was slow from the start and needs z_start (two real clean dp2 runs under
            # 44-58% foreign CPU: a rank 6-8% above its one peer on every step but the first, which was
            # off (the peer slow there), split after 2 steps and taken back to step 1)
            level = float(x[flag & steps.between(onset, last)].median())
            return onset if level >= cfg.z_start * sigma else None
        level = float(x[flag & steps.between(first, last)].median())
        if first in shifts or level < cfg.z_start * sigma:
            return None  # it had a history and did not shift; or too small to call without one
        return first

    def _candidates(self, grid: ScoreGrid, flag: np.ndarray, min_count: int,
                    screens: Sequence[tuple[Callable[[np.ndarray], np.ndarray], int]] = (),
                    chunk: int = 512) -> Iterator[tuple[int, pd.DataFrame]]:
        """(rank, rows) of the ranks with at least `min_count` flagged steps, in rank order: the per-rank
        analysis (onset, history) only runs for those, which keeps 10^4-rank runs fast. Long rows are
        made `chunk` ranks at a time (a long run can make most ranks candidates). `screens`: (flags,
        max_gap) of each stretch the caller will try, flags(rows) its flag matrix for those grid rows; a
        rank with no persistent run of `min_count` in any of them is passed over, as `stretch` would
        find nothing there (3,072 ranks x 1,000 steps: 1,011 of 1,017 candidates, whose long rows and
        per-rank pandas took half the detector's time)."""
        idx = np.flatnonzero((flag & grid.present).sum(axis=1) >= min_count)
        if screens and len(idx):
            keep = np.zeros(len(idx), dtype=bool)
            for flags, max_gap in screens:
                for i in range(0, len(idx), 4 * chunk):  # bounded temporaries: a few (rows, steps) arrays
                    part = slice(i, i + 4 * chunk)
                    keep[part] |= has_persistent_runs(flags(idx[part]), min_count, max_gap)
            idx = idx[keep]
        for i in range(0, len(idx), chunk):
            yield from grid.frame(idx[i:i + chunk]).groupby("rank")

    def _slow_compute(self, store: Store, grid: ScoreGrid, sigma: float) -> list[Finding]:
        cfg = self.cfg
        episodes: dict[int, Episode] = {}
        x = grid["x_work_s"]
        with np.errstate(invalid="ignore"):
            flag = x >= max(math.log(cfg.min_ratio), min(cfg.z_flag * sigma, math.log(cfg.gross_ratio)))
            gross = x >= math.log(cfg.gross_ratio)
        rate = self.null_rate(grid, flag)
        gross_rate = self.null_rate(grid, gross)
        screen = (partial(self.episode_flags, grid, measure="work_s", sigma=sigma), cfg.max_gap)
        for rank, rows in self._candidates(grid, flag, cfg.persist_steps, [screen]):
            ep = self.episode(rows, "work_s", sigma, max_gap=cfg.max_gap, min_count=cfg.persist_steps,
                              null_rate=self.rank_rate(grid, rate, rank),
                              gross_rate=self.rank_rate(grid, gross_rate, rank))
            if ep is not None and self._own_slowdown(ep):
                episodes[int(rank)] = ep
        for rank, ep in self._sustained(grid, sigma, set(episodes)).items():
            if self._own_slowdown(ep):
                episodes[rank] = ep
        return [self._straggler(store, rank, ep, sigma) for rank, ep in sorted(episodes.items())]

    def _own_slowdown(self, ep: Episode) -> bool:
        """The rank's own compute, not a launch delay or its replica's work: its forward is slower too (a
        slow chip slows every kernel; backward alone is launch delays inside backward hooks), and the
        same replica's ranks on the other stages were not as slow at the same steps (they compute the
        same micro-batches: long sequences slow them all, a slow GPU only its own)."""
        level = ep.level
        if not float(ep.rows.x_forward_s.median()) >= 0.5 * level:
            return False
        replica = float(ep.rows.x_replica_work_s.median()) if "x_replica_work_s" in ep.rows else float("nan")
        return not replica >= self.cfg.replica_share * level  # NaN (no other stage traced): no veto

    def _replica_data(self, sel: pd.DataFrame, level: float) -> bool:
        """A rank's own-time excess is its replica's data when its compute carries a material part of it
        (>= DATA_WORK_SHARE of the level) and the replica's ranks on the other stages computed at least
        replica_share as much more than their stage peers at the same steps: they got the same long
        sequences (its gaps then are waits on them, also longer). A rank pausing slows its replica's
        other stages through their waits, not their compute, and its own compute is normal."""
        own = float(sel.x_work_s.median())
        replica = float(sel.x_replica_work_s.median()) if "x_replica_work_s" in sel else float("nan")
        return own >= DATA_WORK_SHARE * level and replica >= self.cfg.replica_share * own

    def _sustained(self, grid: ScoreGrid, sigma: float, skip: set[int]) -> dict[int, Episode]:
        """Shifts too small for per-step flags under heavy noise but held for long (issue 13 case 2): a
        one-sided CUSUM of each rank's score (in sigma, clipped) proposes a stretch; the evidence of the
        whole stretch decides (_sustained_episode). Slow from the first step is the per-step test's."""
        cfg = self.cfg
        x_all = grid["x_work_s"]
        scored = ~np.isnan(x_all)
        # the screen runs on the steps and ranks with any score (a pivot of the scores), all ranks at once
        rows_ok, cols_ok = scored.any(axis=1), scored.any(axis=0)
        del scored
        sub = x_all if rows_ok.all() else x_all[rows_ok]
        cusum = np.zeros(len(sub))
        peak = np.zeros(len(sub))
        for j in np.flatnonzero(cols_ok):  # column by column: no copy of the whole matrix
            col = np.nan_to_num(np.minimum(sub[:, j] / sigma, cfg.cusum_clip), nan=0.0)
            cusum = np.maximum(0.0, cusum + col - cfg.cusum_drift)
            peak = np.maximum(peak, cusum)
        del sub
        alarmed = [int(i) for i, r in zip(np.flatnonzero(rows_ok)[peak >= cfg.cusum_h],
                                          grid.ranks[rows_ok][peak >= cfg.cusum_h]) if int(r) not in skip]
        # each alarmed rank's own series (its steps with a row); the CUSUM stretches of the ranks with a
        # row at every step together (12,288 ranks x 1,000 steps: a Python loop per rank-step took ~10 s)
        dense = [i for i in alarmed if grid.present[i].all()]
        stretches: dict[int, list[tuple[int, int]]] = {}
        for c in range(0, len(dense), 2048):  # 2,048 ranks at a time: bounded copies
            part = dense[c:c + 2048]
            zs = np.nan_to_num(x_all[part] / sigma, nan=0.0)
            for i, found in zip(part, cusum_stretches_rows(zs, cfg.cusum_drift, cfg.cusum_clip, cfg.cusum_h)):
                if found:
                    stretches[i] = found
        out = {}
        dense_set = set(dense)
        for i in alarmed:
            if i in dense_set and i not in stretches:
                continue  # no stretch
            x = x_all[i] if i in dense_set else x_all[i, grid.present[i]]  # (a view: only read)
            series = x / sigma
            if not np.isfinite(series).all():  # nan_to_num's result, without its cost on the ~5,000 alarms
                series = np.nan_to_num(series, nan=0.0, copy=False)
            found = stretches[i] if i in stretches else cusum_stretches(series, cfg.cusum_drift, cfg.cusum_clip,
                                                                        cfg.cusum_h)
            for a, b in found:
                ep = self._sustained_episode(partial(grid.frame, np.array([i])), x,
                                             change_point(series, a, b, cfg.sustained_min_steps), b, sigma)
                if ep is not None:
                    out[int(grid.ranks[i])] = ep
                    break
        return out

    def _sustained_episode(self, rows_of: Callable[[], pd.DataFrame], x: np.ndarray, a: int, b: int,
                           sigma: float) -> Episode | None:
        """The stretch [a, b] of the rank's steps (`rows_of()`: its rows, sorted; `x` their x_work_s) against the
        rank's own steps before it: the medians' difference must exceed `sustained_se` standard errors
        (1.2533 sigma / sqrt(steps) per median: the noise of a window's median shrinks with its length),
        and the rank must be above its former level on more steps than chance allows (a sign test: no
        noise shape assumed, so heavy tails do not fool it). The level tests run on numpy first: most
        CUSUM alarms fail them, and a DataFrame slice per alarm cost 9 of the detector's 15 s."""
        cfg = self.cfg
        scored = ~np.isnan(x)
        idx, prev = a + np.flatnonzero(scored[a:b + 1]), np.flatnonzero(scored[:a])
        n, m = len(idx), len(prev)
        if n < cfg.sustained_min_steps or m < cfg.sustained_min_steps:
            return None
        level, base = float(median_inplace(x[idx])), float(median_inplace(x[prev]))  # (copies)
        stderr = 1.2533 * sigma * math.sqrt(1 / n + 1 / m)
        if level < math.log(cfg.min_ratio) or level - base < max(math.log(cfg.min_ratio), cfg.sustained_se * stderr):
            return None
        sel = rows_of().iloc[idx]
        if float((sel.work_s - sel.ref_work_s).median()) < cfg.min_excess_frac * float(sel.step_time_s.median()):
            return None
        above = int((x[idx] > base).sum())
        if self.by_chance(above, n, 0.5):
            return None
        first, last = int(sel.step.iloc[0]), int(sel.step.iloc[-1])
        return Episode(first, last, level, sel, [(first, last, above)])

    def _straggler(self, store: Store, rank: int, ep: Episode, sigma: float) -> Finding:
        ratio = math.exp(ep.level)
        fwd = float(ep.rows.x_forward_s.median())
        host = hosts_of(store.topology, [rank])
        return Finding(
            kind="straggler", ranks=[rank], hosts=host, steps=(ep.first, ep.last), severity=ratio,
            summary=(f"Rank {rank} on {host[0] if host else '?'} computes {100 * (ratio - 1):.0f}% slower than "
                     f"the ranks of its pipeline stage since step {ep.first}; check that GPU (clocks, "
                     f"thermals, ECC) or drain the host."),
            evidence={"cause": "slow_compute", "stage": int(ep.rows.pp.iloc[0]),
                      "compute_ratio_vs_stage": round(ratio, 4),
                      "forward_ratio_vs_stage": round(math.exp(fwd), 4),
                      "compute_ratio_vs_tp_group": _round(ep.rows.tp_ratio.median()),
                      "robust_z": round(ep.level / sigma, 2), "noise_sigma": round(sigma, 4),
                      "flagged_steps": len(ep.rows), "episodes": [list(r[:2]) for r in ep.runs]})

    def _late_launch(self, store: Store, grid: ScoreGrid, sigma: float, stragglers: set[int]) -> list[Finding]:
        cfg = self.cfg
        out = []
        x_own, gap = grid["x_own_s"], grid["gap_s"] - grid["ref_gap_s"]
        own_sigma = noise_sigma_grid(grid, x_own)
        gap_sigma = noise_sigma_grid(grid, gap, floor=1e-5)
        own_min = max(math.log(cfg.min_ratio), min(cfg.z_late * own_sigma, math.log(cfg.gross_ratio)))
        gap_min = max(cfg.min_gap_s, cfg.z_gap * gap_sigma)
        with np.errstate(invalid="ignore"):
            own_flag = x_own >= own_min
            gap_flag = gap >= gap_min
            own_gross = x_own >= math.log(cfg.gross_ratio)
        del gap
        flag = own_flag | gap_flag
        # chance tests at the run's own flag rates: host pauses on every rank (GC recorded as host spans,
        # counted in gaps since the independent suite's late_launch_recorded_gc cases) put a few flags on
        # any rank; 3 of 8 steps at a 5% rate is chance among 800 rank-steps (tuned seeds 0-1 of
        # benchmarks/accuracy_independent.py: 2 false late_launch findings of ~2-6 ms "every 2-9 steps"
        # without this test, 0 with it; the recorded pauses found on all 4 runs)
        own_rate, gap_rate = self.null_rate(grid, own_flag), self.null_rate(grid, gap_flag)
        gross_rate = self.null_rate(grid, own_gross)
        own_flags = partial(self.episode_flags, grid, measure="own_s", sigma=own_sigma, z_flag=cfg.z_late)
        screens = [(own_flags, cfg.max_gap), (partial(self._gap_flags, grid, gap_min), cfg.late_max_period)]
        for rank, rows in self._candidates(grid, flag, cfg.late_min_count, screens):
            if rank in stragglers:
                continue
            # own time (pauses inside backward hooks and the optimizer, before their collectives) or,
            # for short pauses in long steps, the host gaps alone in seconds
            measure = "own_s"
            ep = self.episode(rows, "own_s", own_sigma, max_gap=cfg.max_gap, min_count=cfg.late_min_count,
                              z_flag=cfg.z_late, null_rate=self.rank_rate(grid, own_rate, rank),
                              gross_rate=self.rank_rate(grid, gross_rate, rank))
            if ep is None:
                measure = "gap_s"
                gap_excess = rows.gap_s - rows.ref_gap_s
                ep = self.stretch(rows, gap_excess, gap_min, gap_excess > 0, gap_sigma, cfg.late_max_period,
                                  cfg.late_min_count, periodic=True, null_rate=self.rank_rate(grid, gap_rate, rank))
            if ep is None:
                continue
            sel = ep.rows
            excess = sel[measure] - sel[f"ref_{measure}"]
            if float(excess.median()) < cfg.min_gap_s:
                continue
            if float(sel.x_forward_s.median()) >= max(math.log(cfg.min_ratio), cfg.z_flag * sigma):
                continue  # its compute is slow too: not a launch problem
            if float((sel.gap_p2p_s / excess).median()) >= 0.5:
                continue  # delays before pipeline transfers: a link problem (flaps.py)
            if measure == "own_s" and self._replica_data(sel, ep.level):
                continue
            excess_ms = 1e3 * float(excess.median())
            host = hosts_of(store.topology, [int(rank)])
            steps = sorted(int(s) for s in sel.pos)  # positions: "every step" of a sampled trace too
            period = int(pd.Series(steps).diff().median()) if len(steps) > 1 else 1
            out.append(Finding(
                kind="late_launch", ranks=[int(rank)], hosts=host, steps=(ep.first, ep.last),
                severity=float(1 + (excess / sel.ref_own_s.clip(lower=1e-9)).median()),
                summary=(f"Rank {rank} on {host[0] if host else '?'} issues its collectives ~{excess_ms:.1f} ms late "
                         f"{'every step' if period <= 1 else f'every {period} steps'} while its compute is "
                         f"normal; look for host-side pauses there (garbage collection, CPU contention)."),
                evidence={"cause": "late_launch", "stage": int(rows.pp.iloc[0]), "excess_ms": round(excess_ms, 3),
                          "flagged_steps": len(steps), "period_steps": period, "measure": measure,
                          "level": round(ep.level, 4)}))
        return out

    @staticmethod
    def _gap_flags(grid: ScoreGrid, gap_min: float, rows: np.ndarray) -> np.ndarray:
        """The flags of _late_launch's gap stretch (the host gaps' excess at gap_min, and positive) for
        the grid rows `rows` (False where a rank has no row)."""
        excess = grid["gap_s"][rows] - grid["ref_gap_s"][rows]
        with np.errstate(invalid="ignore"):
            return (excess >= gap_min) & (excess > 0) & grid.present[rows]

    def _imbalance(self, store: Store, grid: ScoreGrid, sigma: float) -> list[Finding]:
        cfg = self.cfg
        bal = stage_balance(grid)
        if bal.empty:
            return []
        threshold = max(math.log(cfg.imbalance_ratio), cfg.z_imbalance * noise_sigma(bal, "y", key="pp"))
        out = []
        for stage, rows in bal.groupby("pp"):
            found = persistent_runs(rows.pos[rows.y >= threshold], cfg.persist_steps, max_gap=2)
            if not found:
                continue
            # the ratio over every step of the stretch, not only its flagged ones (a stretch may hold up
            # to 2 unflagged steps in a row: leaving them out would report only its high steps)
            sel = rows[rows.pos.between(found[0][0], found[-1][1])]
            first, last = int(sel.step.iloc[0]), int(sel.step.iloc[-1])
            ratio = float(np.exp(sel.y.median()))
            ranks = store.topology.loc[store.topology.pp == stage, "rank"].astype(int).tolist()
            out.append(Finding(
                kind="stage_imbalance", ranks=ranks, hosts=hosts_of(store.topology, ranks),
                steps=(int(first), int(last)), severity=ratio,
                summary=(f"Pipeline stage {stage} takes {100 * (ratio - 1):.0f}% longer than the other stages "
                         f"since step {first} (all its ranks alike: a partition imbalance, not a bad rank); "
                         f"move layers off stage {stage} or rebalance the split."),
                evidence={"cause": "stage_imbalance", "stage": int(stage), "ratio_vs_other_stages": round(ratio, 4),
                          "stage_compute_s": round(float(sel.stage_work_s.median()), 6)}))
        return out


def stage_balance(grid: ScoreGrid) -> pd.DataFrame:
    """Per step and stage: y = log(the stage's low-quartile rank work / the other stages' median work);
    pos: the step's position among the analyzed steps."""
    stages = np.unique(grid.pp)
    if len(stages) < 2:
        return pd.DataFrame(columns=["step", "pos", "pp", "y", "stage_work_s"])
    work, here = grid["work_s"], grid.present
    n_steps = len(grid.steps)
    low, med = np.full((len(stages), n_steps), np.nan), np.full((len(stages), n_steps), np.nan)
    for i, p in enumerate(stages):
        w, h = work[grid.pp == p], here[grid.pp == p]
        if h.all():
            low[i] = np.quantile(w, 0.25, axis=0, method="lower")
            med[i] = np.median(w, axis=0)
        else:
            for c in np.flatnonzero(h.any(axis=0)):
                col = w[h[:, c], c]
                low[i, c], med[i, c] = np.quantile(col, 0.25, method="lower"), np.median(col)
    rows = []
    exists = ~np.isnan(med)
    # the other stages' median per stage and step: along the stage axis at once when every stage has a
    # value at every step (8 stages x 1,000 steps: 8,000 medians of 7 values took ~0.2 s one by one)
    ref_all = (np.stack([np.median(np.delete(med, k, axis=0), axis=0) for k in range(len(stages))])
               if exists.all() else None)
    for j, step in enumerate(grid.steps):
        for k in np.flatnonzero(exists[:, j]):
            if ref_all is not None:
                ref = float(ref_all[k, j])
            else:
                others = med[exists[:, j] & (np.arange(len(stages)) != k), j]
                ref = float(np.median(others)) if len(others) else float("nan")
            rows.append((int(step), j, int(stages[k]), math.log(max(low[k, j], 1e-9) / max(ref, 1e-9)), med[k, j]))
    return pd.DataFrame(rows, columns=["step", "pos", "pp", "y", "stage_work_s"])


def _round(value: float, digits: int = 4) -> float | None:
    return round(float(value), digits) if value == value else None
