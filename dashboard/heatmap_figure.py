"""The rank x step heatmap (MegaScale Fig. 7) from an analyzer Heatmap, and click decoding.

The analyzer aggregates in DuckDB down to at most max_rows x max_cols cells, so the figure never
holds more than a few hundred thousand values whatever the size of the job. A click is decoded
from the cell's labels (step or step bin, rank) to open the timeline at that step.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from megascope.analyzer.views.heatmap import HOST_VIEW, color_range
from megascope.analyzer.views.heatmap import METRICS as HEATMAP_METRICS
from megascope.dashboard.widgets import FIGURE_MARGIN, FIGURE_TEMPLATE, empty_figure

METRICS: dict[str, str] = {name: m.label for name, m in HEATMAP_METRICS.items()}
"""Metric -> label, for the menus (the list itself is the analyzer's)."""
GROUPINGS: dict[str, str] = {"rank": "rank", "dp": "data parallel", "pp": "pipeline stage",
                             "tp": "tensor parallel", "host": "host"}
_HIGHER_IS_WORSE = {name for name, m in HEATMAP_METRICS.items() if m.higher_is_worse}
_HOST = {name for name, m in HEATMAP_METRICS.items() if m.source == HOST_VIEW}
_LEADING_INT = re.compile(r"-?\d+")


def heatmap_figure(heatmap: Any, metric: str, group_by: str) -> go.Figure:
    """A Plotly heatmap of analyzer Heatmap rows x step columns, warm colors where it hurts."""
    rows, cols, values = _parts(heatmap)
    if values.size == 0:
        return empty_figure("No host samples in this run: megascope's tracer records them per step, imported "
                            "traces have none" if metric in _HOST else "No steps recorded yet")
    zmin, zmax, clipped = color_range(values, metric in _HIGHER_IS_WORSE)
    fig = go.Figure(go.Heatmap(
        z=values, x=[str(c) for c in cols], y=[str(r) for r in rows], zmin=zmin, zmax=zmax,
        colorscale="YlOrRd" if metric in _HIGHER_IS_WORSE else "YlOrRd_r",
        colorbar=dict(title=METRICS.get(metric, metric) + ("<br>(outliers clipped)" if clipped else "")),
        hovertemplate=f"{GROUPINGS.get(group_by, group_by)} %{{y}}<br>step %{{x}}<br>"
                      f"{METRICS.get(metric, metric)}: %{{z:.4g}}<extra>click: open in timeline</extra>",
    ))
    fig.update_layout(template=FIGURE_TEMPLATE, margin=FIGURE_MARGIN, height=max(360, min(900, 18 * len(rows) + 120)),
                      xaxis=dict(title="step", type="category"),
                      yaxis=dict(title=GROUPINGS.get(group_by, group_by), type="category", autorange="reversed"))
    return fig


def clicked_cell(click_data: dict | None, group_by: str) -> tuple[int, int | None] | None:
    """(step, rank or None) of a clicked heatmap cell, None when nothing usable was clicked.

    Decoded from the cell's labels: plotly.js does not pass a heatmap's customdata in click events.
    """
    if not click_data or not click_data.get("points"):
        return None
    point = click_data["points"][0]
    step = leading_int(point.get("x"))
    rank = leading_int(point.get("y")) if group_by == "rank" else -1
    if step < 0:
        return None
    return step, (rank if rank >= 0 else None)


class _ReorderedHeatmap:
    def __init__(self, rows: list, cols: list, values: np.ndarray):
        self.rows, self.cols, self.values = rows, cols, values


def ordered_rows(heatmap: Any, topology: pd.DataFrame, order: str) -> Any:
    """Reorder per-rank rows so ranks of one stage / replica / host sit together."""
    key_cols = {"pp": ["pp", "dp", "tp"], "dp": ["dp", "pp", "tp"], "tp": ["tp", "pp", "dp"],
                "host": ["host", "local_rank"]}.get(order)
    if key_cols is None or topology.empty:
        return heatmap
    position = {int(r): i for i, r in enumerate(topology.sort_values(key_cols)["rank"])}
    labels = list(heatmap.rows)
    sort = sorted(range(len(labels)), key=lambda i: position.get(leading_int(labels[i]), len(position) + i))
    return _ReorderedHeatmap([labels[i] for i in sort], list(heatmap.cols), np.asarray(heatmap.values)[sort])


def _parts(heatmap: Any) -> tuple[list, list, np.ndarray]:
    values = np.asarray(heatmap.values, dtype=float)
    return list(heatmap.rows), list(heatmap.cols), values


def leading_int(label: Any) -> int:
    """A step or rank from a label: 12, '12', 'rank 3', '100-109' (a bin: its first step)."""
    if isinstance(label, (int, np.integer)):
        return int(label)
    match = _LEADING_INT.search(str(label))
    return int(match.group()) if match else -1
