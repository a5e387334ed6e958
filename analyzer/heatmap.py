"""Heatmaps (rows x steps) of a per-rank-step metric, aggregated and downsampled in DuckDB so a
12,288-rank x 1,000-step run comes back as at most max_rows x max_cols numbers.

Reads the per-rank-step summary (summary_cache.py: rank_step + late arrivals, persisted in the run
directory), so a heatmap of a big run does not rescan its events."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megascope.analyzer.store import Store, load_sql
from megascope.analyzer.summary_cache import SUMMARY_VIEW

METRICS = {
    # name: (SQL over the rank-step summary, unit, aggregate that keeps the bad cells visible)
    "compute": ("forward_s + backward_s", "s", "max"),
    "forward": ("forward_s", "s", "max"),
    "backward": ("backward_s", "s", "max"),
    "exposed_comm": ("least(collective_s, greatest(step_time_s - compute_s - recv_s - data_wait_s, 0))", "s", "max"),
    "lateness": ("coalesce(lateness_s, 0)", "s", "max"),
    "step_time": ("step_time_s", "s", "max"),
    "mfu": ("model_flops / (step_time_s * {world} * {peak})", "ratio", "min"),
}
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


def heatmap(store: Store, metric: str, group_by: str = "rank", max_rows: int = 512, max_cols: int = 500,
            source: str = SUMMARY_VIEW) -> Heatmap:
    """`source`: a relation with rank_step's columns and lateness_s (the summary view)."""
    if metric not in METRICS:
        raise ValueError(f"unknown heatmap metric '{metric}'; choose one of {', '.join(METRICS)}")
    if group_by not in GROUPS:
        raise ValueError(f"unknown group_by '{group_by}'; choose one of {', '.join(GROUPS)}")
    if max_rows < 1 or max_cols < 1:
        raise ValueError("max_rows and max_cols must be >= 1")
    expr, unit, agg = METRICS[metric]
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
