"""Heatmaps (rows x steps) of a per-rank-step metric, aggregated and downsampled in DuckDB so a
12,288-rank x 1,000-step run comes back as at most max_rows x max_cols numbers.

Reads the per-rank-step summary (summary_cache.py: rank_step + late arrivals, persisted in the run
directory), so a heatmap of a big run does not rescan its events."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from megascope.analyzer.data.store import Store, load_sql
from megascope.analyzer.data.summary_cache import SUMMARY_VIEW

HOST_VIEW = "rank_step_host"
"""The rank-steps' host samples beside the summary's keys (data/sql/rank_step_host.sql): the source of
the cause measures."""


class Metric(NamedTuple):
    sql: str
    """SQL over the rank-step summary ({world} and {peak} filled in), or over HOST_VIEW for a cause measure."""
    unit: str
    agg: Literal["max", "min"]
    """How cells fold into one (downsampling) so the bad ones stay visible: max where higher is worse."""
    label: str
    """What the dashboard and the report call it."""
    source: str = SUMMARY_VIEW
    """The relation `sql` reads."""

    @property
    def higher_is_worse(self) -> bool:
        return self.agg == "max"


METRICS: dict[str, Metric] = {
    "compute": Metric("forward_s + backward_s", "s", "max", "compute time (s)"),
    "forward": Metric("forward_s", "s", "max", "forward compute (s)"),
    "backward": Metric("backward_s", "s", "max", "backward compute (s)"),
    "exposed_comm": Metric("least(collective_s, greatest(step_time_s - compute_s - recv_s - data_wait_s, 0))", "s",
                           "max", "exposed communication (s)"),
    "lateness": Metric("coalesce(lateness_s, 0)", "s", "max", "arrival lateness (s)"),
    "step_time": Metric("step_time_s", "s", "max", "step time (s)"),
    "mfu": Metric("model_flops / (step_time_s * {world} * {peak})", "ratio", "min", "MFU"),
    # the cause measures (detect/cause.py's evidence), one per cause a finding's explained_by can name
    "data_wait": Metric("data_wait_s", "s", "max", "data-loader wait (s)"),
    "gc": Metric("gc_s", "s", "max", "garbage-collection pauses (s)", HOST_VIEW),
    "run_delay": Metric("run_delay_s", "s", "max", "waiting for a CPU: run delay (s)", HOST_VIEW),
    "throttled": Metric("throttled_s", "s", "max", "CPU-quota throttled (s)", HOST_VIEW),
}
"""The heatmap metrics, the one list: the dashboard's menu and the report draw from it."""
CAUSE_METRICS = {"data_loading": "data_wait", "garbage_collection": "gc", "cpu_contention": "run_delay",
                 "cpu_quota": "throttled", "slow_compute": "compute"}
"""The metric that shows each cause (a finding's explained_by) per rank x step."""
GROUPS = {"rank": "rank", "dp": "dp", "pp": "pp", "tp": "tp", "host": "host"}


@dataclass
class Heatmap:
    metric: str
    unit: str
    group_by: str
    rows: list[str]
    """Row labels ('12' or '12..15' when ranks/groups were folded into one row)."""
    cols: list[int]
    """First step of each column."""
    values: np.ndarray
    """rows x cols, NaN where there is no data."""


def heatmap(store: Store, metric: str, group_by: str = "rank", max_rows: int = 512, max_cols: int = 500) -> Heatmap:
    """`metric` over rank x step from its source (the summary view, which the caller has defined, or
    HOST_VIEW); empty where the source has no rows (a cause measure of a run without host samples)."""
    if metric not in METRICS:
        raise ValueError(f"unknown heatmap metric '{metric}'; choose one of {', '.join(METRICS)}")
    if group_by not in GROUPS:
        raise ValueError(f"unknown group_by '{group_by}'; choose one of {', '.join(GROUPS)}")
    if max_rows < 1 or max_cols < 1:
        raise ValueError("max_rows and max_cols must be >= 1")
    expr, unit, agg, _, source = METRICS[metric]
    if source == HOST_VIEW:
        store.execute(f"CREATE OR REPLACE TEMP VIEW {HOST_VIEW} AS " + load_sql(HOST_VIEW))
    world = int(store.manifest["topology"].get("world") or len(store.topology))
    peak = float((store.manifest.get("peak_flops") or {}).get("per_device") or "nan")
    expr = expr.format(world=world, peak=peak if peak == peak else 1.0)
    sql = load_sql("heatmap").format(source=source, metric_expr=expr, row_key=GROUPS[group_by], agg=agg,
                                     max_rows=int(max_rows), max_cols=int(max_cols))
    df = store.query(sql)
    if df.empty:
        return Heatmap(metric, unit, group_by, [], [], np.zeros((0, 0)))
    rows = df.groupby("row_bucket").row_label.first()
    cols = df.groupby("col_bucket").first_step.min()
    values = np.full((len(rows), len(cols)), np.nan)
    ri = {b: i for i, b in enumerate(rows.index)}
    ci = {b: i for i, b in enumerate(cols.index)}
    values[df.row_bucket.map(ri).to_numpy(), df.col_bucket.map(ci).to_numpy()] = df.value.to_numpy()
    return Heatmap(metric, unit, group_by, [str(r) for r in rows], [int(c) for c in cols], values)


def color_range(values: np.ndarray, higher_is_worse: bool, quantile: float = 0.98,
                outlier: float = 1.5) -> tuple[float | None, float | None, bool]:
    """(zmin, zmax, clipped) for drawing a heatmap (the dashboard's and the HTML report's): a few
    extreme cells (the warm-up step, a restart) would take the whole color scale and wash out a
    straggler, so the bad end is clipped at the 98th percentile of the other columns when the extreme
    is more than 1.5x beyond it (hover still shows the true value).

    "The other columns": a whole step far off the typical one (median over its rows more than 1.5x
    the median step) is left out of the percentile. The warm-up step is one column of every row, 1/30
    of the cells in the demo (30 steps, step 0 at 1.9 s against 0.3-0.4 s): more than the 2% the
    percentile skips, so on runs of under 50 steps the percentile alone lands on the warm-up itself
    and nothing is clipped."""
    finite = values[np.isfinite(values)]
    if finite.size < 20:
        return None, None, False
    with warnings.catch_warnings():  # all-NaN columns (no data yet) have no median: kept out below
        warnings.simplefilter("ignore", RuntimeWarning)
        columns = np.nanmedian(values, axis=0) if values.ndim == 2 else np.asarray([np.nanmedian(values)])
    typical = float(np.nanmedian(columns))
    odd = columns > outlier * typical if higher_is_worse else columns < typical / outlier
    base = values[:, ~odd] if values.ndim == 2 and odd.any() and not odd.all() else values
    base = base[np.isfinite(base)]
    if base.size == 0:
        base = finite
    if higher_is_worse:
        top = float(np.quantile(base, quantile))
        if top > 0 and float(finite.max()) > outlier * top:
            return float(finite.min()), top, True
    else:
        bottom = float(np.quantile(base, 1 - quantile))
        if bottom > 0 and float(finite.min()) < bottom / outlier:
            return bottom, float(finite.max()), True
    return None, None, False
