"""Network flaps and slow links, per p2p link (rank pair) and per collective group instance.

Three series, each against the links/groups of the same kind at the same step:
- p2p transfer time with peer waiting removed (the per-step floor of min(send, recv) durations), on
  traces whose p2p spans end when the transfer does (GPU, simulated, imported); on CPU (gloo) traces
  a p2p span ends at its host's wait(), so this series is skipped there;
- collective transfer time (end - last arrival), also skipped on CPU (gloo) traces, where an async
  collective's end is when the tracer observed its completion;
- p2p stalls: host time both ends of a link lost right before issuing their transfers to each other
  (a NIC or driver that blocks the issue: the transfer itself then looks normal, but both ends stall
  in the same steps; one end alone stalling is that rank's late launch, not the link).
A step is degraded when the ratio >= `flag_ratio` and beyond the run's noise (`z_flag` x the
step-to-step noise of the log ratio, median over links), and the extra time is real (`min_extra_s`;
stalls: `min_stall_frac` of the step). A link degraded on most steps is steadily slow (`slow_link`);
one that collapses and recovers in episodes flaps (`network_flap`, with the episodes and their count).

A p2p link is also judged against the other links of its pipeline boundary (the same pair of stages)
over the whole run: a boundary whose transfers all carry some peer waiting on random steps (batched
send+recv ops whose spans end with the slower of their two transfers) has each link "degraded" on
many steps, and per step half of them sit above the median. A link counts only when it is degraded
on more steps than the other links of its boundary make likely (`_beyond_boundary`). Links of one
boundary still flagged together beyond `group_links` share a cause (their switch, or the schedule):
they are reported as one finding that says so, never one finding per link.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from megascope.analyzer.data.event_pass import has_wait_spans
from megascope.analyzer.data.group_instances import group_members
from megascope.analyzer.data.store import Store, load_sql
from megascope.analyzer.detect.context import DetectContext
from megascope.analyzer.detect.episodes import runs
from megascope.analyzer.detect.p2p_link_ids import (
    LinkIds,
    above_boundary_peaks,
    above_peaks,
    link_frame,
    observed_counts,
)
from megascope.analyzer.detect.p2p_pairs import LinkPairs, read_pairs
from megascope.analyzer.detect.peer_stats import (
    noise_sigma,
    noise_sigma_dense,
    warmup_steps,
)
from megascope.analyzer.findings import Finding, Kind, hosts_of, rank_list
from megascope.analyzer.settings import FlapConfig


class FlapDetector:
    def __init__(self, config: FlapConfig | None = None) -> None:
        self.cfg = config or FlapConfig()

    def detect(self, ctx: DetectContext) -> list[Finding]:
        store = ctx.store
        bounds = store.query("SELECT step, min(start_ns) AS start_ns, max(end_ns) AS end_ns, "
                             "median(step_time_s) AS step_time_s FROM rank_step GROUP BY step")
        warm = sorted(int(s) for s in warmup_steps(bounds, ctx.warmup_factor)) if len(bounds) else []
        bounds = bounds[~bounds.step.isin(warm)].set_index("step")
        n_steps = len(bounds)
        if n_steps == 0:
            return []
        wait_spans = has_wait_spans(store)  # CPU (gloo) traces: one query over the first rank's events
        # both p2p series read one pairing of each link's two ends: numpy's dense links x steps cells
        # (p2p_pairs.py), or where those would not be dense, p2p_links.sql's table (dropped once read)
        pairs: LinkPairs | _SqlPairs | None = read_pairs(store, warm)
        if pairs is None:
            pairs = _SqlPairs(store, warm)
        try:
            out = self._p2p(store, pairs, n_steps, bounds, wait_spans) + self._stalls(store, pairs, n_steps, bounds)
        finally:
            del pairs
            store.execute("DROP TABLE IF EXISTS p2p_link_pairs")
        links = group_boundaries(_dedupe_links(out), store.topology, self.cfg.group_links)
        return links + self._collectives(store, n_steps, bounds, warm, wait_spans)

    def _threshold(self, sigma: float) -> float:
        """The log ratio a step must reach: the flag ratio, and beyond z_flag noise sigmas."""
        return max(np.log(self.cfg.flag_ratio), self.cfg.z_flag * sigma)

    def _degraded(self, series: pd.DataFrame, key: list[str], value: str) -> pd.DataFrame:
        """Rows of a (key, step, value, baseline_s, ratio) series (warm-up steps left out) that are
        degraded beyond the noise."""
        c = self.cfg
        if series.empty:
            return series
        with np.errstate(divide="ignore", invalid="ignore"):
            lr = np.log(series.ratio.to_numpy(dtype=float))
        # the noise keyed by one dense id per key (grouping 1.66 M collective rows by two string columns
        # and the instance took most of this method's ~0.5 s at 12,288 x 1,000)
        sigma = _keyed_noise(_key_ids(series, key), series.step.to_numpy(dtype=np.int64), lr)
        with np.errstate(invalid="ignore"):
            keep = (lr >= self._threshold(sigma)) & (series[value].to_numpy(dtype=float) -
                                                      series.baseline_s.to_numpy(dtype=float) >= c.min_extra_s)
        return series[keep].assign(lr=lr[keep])

    def _p2p(self, store: Store, pairs: LinkPairs | _SqlPairs, n_steps: int, bounds: pd.DataFrame,
             wait_spans: bool) -> list[Finding]:
        if wait_spans:
            # CPU (gloo) traces: a p2p span ends when its host called wait(), so its floor measures the
            # hosts' scheduling, not the link (8 ranks on 2 cores gave false 2-step "flaps" of +1 ms);
            # there a link shows as both ends stalled before their transfers (_stalls)
            return []
        got = self._cells_degraded(pairs, store.topology) if isinstance(pairs, LinkPairs) else \
            self._rows_degraded(pairs.series(), store.topology)
        if got is None:
            return []
        bad, observed = got
        bad = self._beyond_boundary(observed, store.topology, bad)
        return self._links(store, bad, "floor_s", n_steps, bounds, "transfer")

    def _rows_degraded(self, s: dict[str, np.ndarray], topology: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series] | None:
        """The degraded p2p rows (src, dst, step, floor_s, baseline_s, ratio, lr) beyond the noise and the
        boundary's peaks, and the observed steps per link (LinkIds.observed_steps), from p2p_series' rows
        (`s`); None without rows."""
        # numpy arrays, not a frame: at 12,288 x 1,000 the series is 21.5 M link-steps, and only the few
        # degraded ones become rows (warm-up steps are left out by the pairing)
        if not len(s["step"]):
            return None
        floor, base = s["floor_s"], s["baseline_s"]
        # the log of floor_s / baseline_s, the ratio divided here as SQL would (IEEE division: the same
        # double), NaN without a baseline; one array, logged in place
        lr = np.full(len(floor), np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(floor, base, out=lr, where=base != 0)
            np.log(lr, out=lr)
        # the rows over the flag ratio with real extra time, taken before the noise is known (its
        # threshold is never below the flag ratio's), so that the series' other columns can go first
        with np.errstate(invalid="ignore"):
            rows = np.flatnonzero(lr >= np.log(self.cfg.flag_ratio))
        rows = rows[floor[rows] - base[rows] >= self.cfg.min_extra_s]
        bad = pd.DataFrame({"src": s["src"][rows], "dst": s["dst"][rows], "step": s["step"][rows],
                            "floor_s": floor[rows], "baseline_s": base[rows], "ratio": floor[rows] / base[rows],
                            "lr": lr[rows]})
        src, dst, step = s["src"], s["dst"], s["step"]
        del s, floor, base  # what is left reads the links, steps and log ratios
        links = LinkIds(src, dst, topology)
        del src, dst
        bad = bad[bad.lr.to_numpy() >= self._threshold(_keyed_noise(links.directed, step, lr))]
        return above_boundary_peaks(links, lr, bad), links.observed_steps(step)

    def _cells_degraded(self, pairs: LinkPairs, topology: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series] | None:
        """_rows_degraded on the pairing's matrices (p2p_pairs.py): the same rows and observed steps,
        without p2p_series' 21.5 M rows at 12,288 x 1,000 (their ~0.7 GB of fresh arrays, and the
        factorizing of their links, cost more than the reading; the log ratios overwrite the floors)."""
        floors = pairs.take_floors()
        has = ~np.isnan(floors)
        n_rows = int(np.count_nonzero(has))
        if not n_rows:
            return None
        n_links = len(pairs.a)
        observed = (has[:n_links] | has[n_links:]).sum(axis=1)   # steps with a floor either way
        ratios = _CellRatios(self.cfg, pairs, floors)
        lr = ratios.lr   # the floors' memory
        bad = ratios.bad
        links = link_frame(pairs.a, pairs.b, topology)
        block = _dense_rows(has) if ratios.finite == n_rows else None
        if block is not None:   # every directed link with a floor has one on every step in between
            keys, cols = block
            sigma = noise_sigma_dense(lr[:, cols] if keys.all() else lr[keys][:, cols])
        else:   # _keyed_noise's frame: the cells with a floor, keyed by their row
            row, col = np.nonzero(has)
            key = np.unique(row, return_inverse=True)[1].astype(np.int32)
            sigma = _keyed_noise(key, col + np.int64(pairs.lo), lr[row, col])
        del has
        bad = bad[bad.lr.to_numpy() >= self._threshold(sigma)]
        if not bad.empty:
            top = np.maximum(ratios.top[:n_links], ratios.top[n_links:])
            seen = ratios.any_finite[:n_links] | ratios.any_finite[n_links:]
            bad = above_peaks(links, top, seen, bad)
        return bad, observed_counts(links, observed)

    def _stalls(self, store: Store, pairs: LinkPairs | _SqlPairs, n_steps: int, bounds: pd.DataFrame) -> list[Finding]:
        got = self._stall_cells(pairs, bounds, store.topology) if isinstance(pairs, LinkPairs) else \
            self._stall_rows(pairs.stalls(), bounds, store.topology)
        if got is None:
            return []
        bad = self._beyond_boundary(got[1], store.topology, got[0])
        return self._links(store, bad, "stall_s", n_steps, bounds, "stall")

    def _stall_rows(self, s: dict[str, np.ndarray], bounds: pd.DataFrame,
                    topology: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series] | None:
        """The degraded stall rows (src, dst, step, stall_s, baseline_s, ratio) and the observed steps per
        link, from p2p_stalls' rows (`s`); None when no row is degraded."""
        c = self.cfg
        if not len(s["step"]):
            return None
        stall, base, step = s["stall_s"], s["baseline_s"], s["step"]
        lo = int(step.min())
        step_time = _step_times(bounds, lo, int(step.max()) - lo + 1)[step - lo]
        with np.errstate(invalid="ignore"):
            rows = np.flatnonzero((stall - base >= c.min_stall_frac * step_time) & (stall >= c.flag_ratio * base))
        b = base[rows]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.divide(stall[rows], b, out=np.full(len(rows), np.nan), where=b != 0)
        bad = pd.DataFrame({"src": s["a"][rows], "dst": s["b"][rows], "step": step[rows], "stall_s": stall[rows],
                            "baseline_s": b, "ratio": ratio})
        if bad.empty:
            return None
        return bad, LinkIds(s["a"], s["b"], topology).observed_steps(step)

    def _stall_cells(self, pairs: LinkPairs, bounds: pd.DataFrame,
                     topology: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series] | None:
        """_stall_rows on the pairing's matrices, _CHUNK links at a time (p2p_stalls' 10.75 M rows at
        12,288 x 1,000 not made)."""
        c = self.cfg
        base, group = pairs.stall_baselines()
        step_time = _step_times(bounds, pairs.lo, pairs.stall.shape[1])
        parts = []
        for r0 in range(0, len(pairs.stall), _CHUNK):
            st, b = pairs.stall[r0:r0 + _CHUNK], base[group[r0:r0 + _CHUNK]]   # b: NaN off p2p_stalls
            with np.errstate(invalid="ignore"):
                r, col = np.nonzero((st - b >= c.min_stall_frac * step_time) & (st >= c.flag_ratio * b))
            sr, br = st[r, col], b[r, col]
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.divide(sr, br, out=np.full(len(r), np.nan), where=br != 0)
            parts.append(pd.DataFrame({"src": pairs.a[r0 + r], "dst": pairs.b[r0 + r],
                                       "step": col + np.int64(pairs.lo), "stall_s": sr, "baseline_s": br,
                                       "ratio": ratio}))
        bad = pd.concat(parts, ignore_index=True)
        if bad.empty:
            return None
        counts = np.where(group < len(base) - 1, pairs.present.sum(axis=1), 0)   # p2p_stalls' links
        return bad, observed_counts(link_frame(pairs.a, pairs.b, topology), counts)

    def _beyond_boundary(self, observed: pd.Series, topology: pd.DataFrame, bad: pd.DataFrame) -> pd.DataFrame:
        """The degraded rows (src, dst, step) of the links degraded on more steps than the other links of
        their boundary (same pair of stages) explain: count > n*p0 + z*sqrt(n*p0*(1-p0)), with n the
        link's observed steps (`observed`, LinkIds.observed_steps) and p0 the other links' share of
        degraded steps."""
        if bad.empty:
            return bad
        degraded = _link_steps(bad, topology).groupby(["lo", "hi", "a", "b"]).size()
        degraded = degraded.reindex(observed.index, fill_value=0)
        boundary = ["lo", "hi"]
        others_deg = degraded.groupby(level=boundary).transform("sum") - degraded
        others_obs = observed.groupby(level=boundary).transform("sum") - observed
        p0 = (others_deg / others_obs.where(others_obs > 0)).fillna(0.0)
        bound = observed * p0 + self.cfg.boundary_z * np.sqrt(observed * p0 * (1 - p0))
        keep = degraded[degraded > bound].index.droplevel(boundary)
        pairs = pd.MultiIndex.from_arrays([bad[["src", "dst"]].min(axis=1), bad[["src", "dst"]].max(axis=1)])
        return bad[pairs.isin(keep)]

    def _links(self, store: Store, bad: pd.DataFrame, value: str, n_steps: int, bounds: pd.DataFrame,
               how: str) -> list[Finding]:
        if bad.empty:
            return []
        bad = bad.assign(a=bad[["src", "dst"]].min(axis=1), b=bad[["src", "dst"]].max(axis=1))
        out = []
        for (a, b), rows in bad.groupby(["a", "b"]):
            per_step = rows.groupby("step").agg(ratio=("ratio", "max"), value=(value, "max"),
                                                baseline=("baseline_s", "median"))
            f = self._classify([int(a), int(b)], per_step, n_steps, bounds, store, what=f"link {a}<->{b}")
            if f:
                f.evidence["signal"] = how
                out.append(f)
        return out

    def _collectives(self, store: Store, n_steps: int, bounds: pd.DataFrame, warm: list[int],
                     wait_spans: bool) -> list[Finding]:
        if wait_spans:
            # CPU (gloo) traces: an async collective's end is when the tracer saw it complete (the next
            # tracer event or sweep, up to ms later), so end - last arrival is not the group's transfer
            # time (a clean real run gave a false dp-group "flap" of +0.9 ms)
            return []
        bad = self._degraded(store.frame(load_sql("collective_series"), {"warm": warm}),
                             ["group", "instance", "name"], "effective_s")
        if bad.empty:
            return []
        out = []
        for (group, instance), rows in bad.groupby(["group", "instance"]):
            per_step = rows.groupby("step").agg(ratio=("ratio", "max"), value=("effective_s", "max"),
                                                baseline=("baseline_s", "median"))
            members = instance_members(store, str(group), int(instance))
            f = self._classify(members, per_step, n_steps, bounds, store,
                               what=f"{group} group of ranks {rank_list(members)}", group=str(group))
            if f:
                out.append(f)
        return out

    def _classify(self, ranks: list[int], per_step: pd.DataFrame, n_steps: int, bounds: pd.DataFrame,
                  store: Store, what: str, group: str = "pp") -> Finding | None:
        c = self.cfg
        # an episode is >= min_episode_steps long: a single degraded step is a hiccup, not a flap
        # runs of consecutive analyzed steps (positions: a sampled trace's ids are N apart), as step ids
        ids = bounds.index.sort_values()
        at = ids.get_indexer(per_step.index)
        episodes = [(int(ids[a]), int(ids[b]), n) for a, b, n in runs(at[at >= 0], max_gap=1)
                    if n >= c.min_episode_steps]
        degraded = len(per_step)
        ratio = float(per_step.ratio.median())
        extra_ms = 1e3 * float((per_step.value - per_step.baseline).median())
        hosts = hosts_of(store.topology, ranks)
        where = " and ".join(hosts[:2]) + ("" if len(hosts) <= 2 else f" (+{len(hosts) - 2} hosts)")
        evidence = {"group": group, "degraded_steps": degraded, "steps_observed": n_steps,
                    "ratio_vs_peers": round(ratio, 3), "extra_ms": round(extra_ms, 3)}
        first, last = int(per_step.index.min()), int(per_step.index.max())
        if degraded >= c.steady_fraction * n_steps:
            return Finding("slow_link", ranks, hosts, (first, last), ratio,
                           f"The {what} ({where}) is steadily {ratio:.1f}x slower than its peers on "
                           f"{degraded}/{n_steps} steps; check that link's cabling, NIC and switch port.",
                           evidence | {"cause": "slow_comm"})
        last_step = int(bounds.index.max())
        # a p2p link may flap once and recover; a collective group's end times also hold its members'
        # late waits on async ops, so one episode there is not evidence enough
        one_recovered = len(episodes) == 1 and episodes[0][2] >= 2 and episodes[0][1] < last_step and group == "pp"
        if len(episodes) < c.min_episodes and not one_recovered:
            return None
        evidence["episodes"] = [
            {"first_step": e[0], "last_step": e[1], "start_ns": int(bounds.start_ns.get(e[0], 0)),
             "end_ns": int(bounds.end_ns.get(e[1], 0)),
             "ratio": round(float(per_step.loc[e[0]:e[1]].ratio.max()), 3)} for e in episodes]
        evidence["episode_count"] = len(episodes)
        evidence["cause"] = "flapping_comm"
        return Finding("network_flap", ranks, hosts, (first, last), ratio,
                       f"The {what} ({where}) flapped {len(episodes)} times between steps {first} and {last} "
                       f"(+{extra_ms:.1f} ms per transfer while down); check that link's NIC, cable "
                       f"and switch port logs for link up/down events.", evidence)


def instance_members(store: Store, group: str, instance: int) -> list[int]:
    """Global ranks of one collective group instance of the stored run (group_instances.group_members with the
    run's sizes; the inverse of group_instances.instance_sql)."""
    man = store.manifest["topology"]
    return group_members(store.topology, int(man["dp"]), int(man["tp"]), int(man["pp"]), group, instance,
                         cp=int(man.get("cp", 1)))


def _arrays(store: Store, sql: str, rows: int | None = None) -> dict[str, np.ndarray]:
    """A query's columns as numpy arrays (NULL: NaN), through Arrow: no pandas frame, whose blocks cost
    a copy and ~1 s per 21.5 M rows. With `rows` (the count, when the caller knows it) each batch is
    copied into its place as it comes, so the Arrow result and the arrays are never both held (~0.7 GB
    at 21.5 M link-steps); a result of another size, or a NULL in an integer column, is read again
    whole."""
    def whole() -> dict[str, np.ndarray]:
        table = store.con.sql(sql).to_arrow_reader(1 << 20).read_all()
        out = {}
        for name in table.column_names:
            out[name] = table.column(name).to_numpy()
            table = table.drop_columns([name])   # its buffers go now, not with the last column
        return out

    def streamed() -> dict[str, np.ndarray] | None:
        assert rows is not None
        reader = store.con.sql(sql).to_arrow_reader(1 << 20)
        out = {f.name: np.empty(rows, dtype=f.type.to_pandas_dtype()) for f in reader.schema}
        at = 0
        for batch in reader:
            end = at + batch.num_rows
            if end > rows:
                return None
            for name, col in zip(batch.schema.names, batch.columns):
                if col.null_count and out[name].dtype.kind != "f":
                    return None
                out[name][at:end] = col.to_numpy(zero_copy_only=False)
            at = end
        return out if at == rows else None

    if rows is not None:
        got = store.run_with_retry(streamed)
        if got is not None:
            return got
    return store.run_with_retry(whole)


_CHUNK = 1024
"""Rows of the floors matrix per step of _CellRatios (temporaries of ~8 MB each at 1,000 steps)."""


class _CellRatios:
    """The floors matrix made, in place and _CHUNK rows at a time, the log ratios against its baselines
    (p2p_series' baseline_s), with what _rows_degraded reads of them: the cells over the flag ratio with
    real extra time (`bad`, its rows), per row the largest finite log ratio (`top`) and whether it has
    one (`any_finite`), and the count of finite ones."""

    def __init__(self, cfg: FlapConfig, pairs: LinkPairs, floors: np.ndarray) -> None:
        base, group = pairs.baselines(floors)
        src, dst = pairs.directed()
        flag = np.log(cfg.flag_ratio)
        self.top = np.full(len(floors), -np.inf)
        self.any_finite = np.zeros(len(floors), dtype=bool)
        self.finite = 0
        parts = []
        for r0 in range(0, len(floors), _CHUNK):
            f = floors[r0:r0 + _CHUNK]
            b = base[group[r0:r0 + _CHUNK]]
            lr = np.full(f.shape, np.nan)
            with np.errstate(divide="ignore", invalid="ignore"):
                np.divide(f, b, out=lr, where=b != 0)   # as _rows_degraded: NaN without a baseline
                np.log(lr, out=lr)
                r, c = np.nonzero((lr >= flag) & (f - b >= cfg.min_extra_s))
            fr, br = f[r, c], b[r, c]
            parts.append(pd.DataFrame({"src": src[r0 + r], "dst": dst[r0 + r], "step": c + np.int64(pairs.lo),
                                       "floor_s": fr, "baseline_s": br, "ratio": fr / br, "lr": lr[r, c]}))
            finite = np.isfinite(lr)
            self.finite += int(np.count_nonzero(finite))
            self.any_finite[r0:r0 + len(f)] = finite.any(axis=1)
            self.top[r0:r0 + len(f)] = np.where(finite, lr, -np.inf).max(axis=1)
            f[...] = lr
        self.lr = floors
        """The log ratios (the floors' memory)."""
        self.bad = pd.concat(parts, ignore_index=True)


class _SqlPairs:
    """The pairing in SQL (p2p_links.sql's table), where read_pairs' dense cells would not fit: the same
    arrays as LinkPairs.series() and .stalls()."""

    def __init__(self, store: Store, warm: list[int]) -> None:
        self.store = store
        store.execute(load_sql("p2p_links"), {"warm": warm})

    def series(self) -> dict[str, np.ndarray]:
        """p2p_series' rows: one per direction with a floor."""
        n = self.store.query("SELECT count(ab_floor_s) + count(ba_floor_s) AS n FROM p2p_link_pairs").n.iloc[0]
        return _arrays(self.store, load_sql("p2p_series"), int(n))

    def stalls(self) -> dict[str, np.ndarray]:
        """p2p_stalls' rows: one per link (a < b) and step."""
        n = self.store.query("SELECT count(*) AS n FROM p2p_link_pairs WHERE a < b").n.iloc[0]
        return _arrays(self.store, load_sql("p2p_stalls"), int(n))


def _step_times(bounds: pd.DataFrame, lo: int, span: int) -> np.ndarray:
    """The median step time of steps lo .. lo + span - 1 (NaN for a step without bounds, as a reindex
    gives; indexing by offset: a reindex of 10.75 M rows' steps took ~0.5 s)."""
    per_step = np.full(span, np.nan)
    known = bounds.index.to_numpy(dtype=np.int64)
    inside = (known >= lo) & (known < lo + span)
    per_step[known[inside] - lo] = bounds.step_time_s.to_numpy(dtype=float)[inside]
    return per_step


def _dense_rows(has: np.ndarray) -> tuple[np.ndarray, slice] | None:
    """(rows, columns) of the cells `has` marks when they fill that block (every row with a cell has one
    on every column from the first to the last with any): _keyed_noise's matrix; else None."""
    keys = np.asarray(has.any(axis=1))
    cols = np.flatnonzero(has.any(axis=0))
    block = slice(int(cols[0]), int(cols[-1]) + 1) if len(cols) else slice(0, 0)
    n = int(np.count_nonzero(keys)) * (block.stop - block.start)
    return (keys, block) if n == int(np.count_nonzero(has)) else None


def _key_ids(series: pd.DataFrame, key: list[str]) -> np.ndarray:
    """One dense int32 id per distinct combination of the `key` columns (-1 where one is missing): each
    column factorized on its own, the codes combined into one int64 and factorized again."""
    code = np.zeros(len(series), dtype=np.int64)
    missing = np.zeros(len(series), dtype=bool)
    for k in key:
        codes, uniques = pd.factorize(series[k])
        missing |= codes < 0
        code *= len(uniques) + 1
        code += codes
    ids = pd.factorize(code)[0].astype(np.int32)
    ids[missing] = -1
    return ids


def _keyed_noise(key: np.ndarray, step: np.ndarray, lr: np.ndarray) -> float:
    """noise_sigma of the log ratio per key (dense ids, -1: no key; non-finite ratios and rows without a
    key left out, as noise_sigma's dropna left them). When every key has every step once (all kept),
    the keys x steps matrix is placed by id and given to noise_sigma_dense; else noise_sigma keyed by
    the one int32 column (its grouping of 21.5 M p2p link-steps by src and dst took ~1 s)."""
    kept = np.isfinite(lr) & (key >= 0)
    n_keys = int(key.max()) + 1 if len(lr) else 0
    lo = int(step.min()) if len(step) else 0
    span = int(step.max()) - lo + 1 if len(step) else 0
    if kept.all() and n_keys * span == len(lr):
        dense = np.full((n_keys, span), np.nan)
        dense[key, step - lo] = lr
        if not np.isnan(dense).any():  # as many rows as cells, each cell filled: each once
            return noise_sigma_dense(dense)
        del dense
    cols = {"key": key, "step": step, "lr": lr}
    if not kept.all():
        cols = {k: v[kept] for k, v in cols.items()}
    # three dtypes, three blocks: copy=False keeps the arrays (one dtype twice would be stacked, a copy)
    return noise_sigma(pd.DataFrame(cols, copy=False), "lr", key="key")


def _link_steps(rows: pd.DataFrame, topology: pd.DataFrame, dedupe: bool = True) -> pd.DataFrame:
    """(lo, hi, a, b, step) once per unordered link and step: lo/hi its stages, a < b its ranks."""
    pp = topology.set_index("rank")["pp"]
    a = np.minimum(rows.src.to_numpy(), rows.dst.to_numpy())
    b = np.maximum(rows.src.to_numpy(), rows.dst.to_numpy())
    pa, pb = pp.reindex(a).to_numpy(), pp.reindex(b).to_numpy()
    out = pd.DataFrame({"lo": np.minimum(pa, pb), "hi": np.maximum(pa, pb), "a": a, "b": b,
                        "step": rows.step.to_numpy()})
    if not dedupe or out.empty:
        return out
    # lo and hi follow from a and b: one int64 code per (a, b, step) finds the same duplicates as the
    # five columns (a hash of one column: ~6x faster on 21.5M link-steps)
    step = out.step.to_numpy(dtype=np.int64)
    a64, b64 = a.astype(np.int64), b.astype(np.int64)
    span = int(step.max() - step.min()) + 1
    code = (a64 * (int(b64.max()) + 1) + b64) * span + (step - step.min())
    return out[~pd.Series(code).duplicated().to_numpy()]


def group_boundaries(findings: list[Finding], topology: pd.DataFrame, max_links: int) -> list[Finding]:
    """p2p link findings: more than `max_links` on one pipeline boundary become one finding (one shared
    cause: their switch, or the schedule's waiting), listing every link in its evidence."""
    pp = dict(zip(topology["rank"].astype(int), topology["pp"].astype(int)))
    by_boundary: dict[tuple[int, int], list[Finding]] = {}
    out = []
    for f in findings:
        if f.evidence.get("group", "pp") == "pp" and len(f.ranks) == 2:
            stages = sorted(pp.get(r, -1) for r in f.ranks)
            by_boundary.setdefault((stages[0], stages[1]), []).append(f)
        else:
            out.append(f)
    for (lo, hi), group in by_boundary.items():
        if len(group) <= max_links:
            out.extend(group)
            continue
        total = int(((topology.pp == lo) | (topology.pp == hi)).sum()) // (2 if lo != hi else 1)
        out.append(_grouped(group, lo, hi, total, topology))
    return out


def _grouped(group: list[Finding], lo: int, hi: int, total: int, topology: pd.DataFrame) -> Finding:
    """One finding for the links of a boundary flagged together."""
    ranks = sorted({r for f in group for r in f.ranks})
    hosts = hosts_of(topology, ranks)
    kind: Kind = "network_flap" if any(f.kind == "network_flap" for f in group) else "slow_link"
    extra_ms = float(np.median([f.evidence.get("extra_ms", 0.0) for f in group]))
    severity = float(np.median([f.severity for f in group]))
    steps = (min(f.steps[0] for f in group), max(f.steps[1] for f in group))
    share = f"all {total}" if len(group) >= total else f"{len(group)} of the {total}"
    where = ", ".join(hosts[:3]) + ("" if len(hosts) <= 3 else f" (+{len(hosts) - 3} hosts)")
    summary = (f"{share} links between stages {lo} and {hi} ({where}) were slow alike on steps {steps[0]}-"
               f"{steps[1]} (+{extra_ms:.1f} ms per transfer, median): one shared cause, not {len(group)} "
               "separate link faults; check the switch or spine these links share, and whether the "
               "pipeline schedule makes these transfers wait (batched send/recv ops).")
    evidence = {"group": "pp", "boundary": [lo, hi], "links": [sorted(f.ranks) for f in group],
                "link_count": len(group), "links_in_boundary": total, "extra_ms": round(extra_ms, 3),
                "shared_cause": True, "cause": group[0].evidence.get("cause", "flapping_comm"),
                "signal": group[0].evidence.get("signal", "transfer")}
    return Finding(kind, ranks, hosts, steps, severity, summary, evidence)


def _dedupe_links(findings: list[Finding]) -> list[Finding]:
    """One finding per link: a stall and a transfer finding on the same pair are the same problem."""
    best: dict[tuple[int, ...], Finding] = {}
    for f in findings:
        key = tuple(sorted(f.ranks))
        if key not in best or f.severity > best[key].severity:
            best[key] = f
    return list(best.values())
