"""The link x step heatmap from an analyzer LinkMap, the network findings outlined on it, and click decoding.

Rows are p2p links grouped by host pair (the analyzer folds them to at most max_rows in DuckDB); a
network finding is drawn as an outline over the rows of its links and the columns of its episodes. A
click is decoded from the cell's labels (step, and the row's first link) to open the timeline there.
"""

from __future__ import annotations

import re
from urllib.parse import urlencode

import numpy as np
import plotly.graph_objects as go

from megascope.analyzer.views.links import METRICS as LINK_METRICS
from megascope.analyzer.views.links import LinkMap
from megascope.dashboard.heatmap_figure import leading_int
from megascope.dashboard.widgets import FIGURE_MARGIN, FIGURE_TEMPLATE, empty_figure

METRICS: dict[str, str] = {name: m.label for name, m in LINK_METRICS.items()}
"""Metric -> label, for the menu (the list itself is the analyzer's)."""
MARK_COLORS = {"network_flap": "#1f4e99", "slow_link": "#6a3d9a"}
_LINK = re.compile(r"· (\d+)-(\d+)")


def link_figure(view: LinkMap, metric: str) -> go.Figure:
    """A Plotly heatmap of links x steps colored by `metric`, warm where it hurts, network findings
    outlined (one rectangle per run of adjacent rows and episode)."""
    values = view.values.get(metric)
    if values is None or values.size == 0:
        return empty_figure("No p2p transfers recorded yet (a run without pipeline stages has none)")
    spec = LINK_METRICS[metric]
    shown, ticks = _log_scale(values)
    fig = go.Figure(go.Heatmap(
        z=shown, customdata=values, x=[str(c) for c in view.cols], y=view.rows,
        colorscale="YlOrRd" if spec.higher_is_worse else "YlOrRd_r",
        colorbar=dict(title=spec.label + "<br>(log scale)", tickvals=[np.log10(t) for t in ticks],
                      ticktext=[f"{t:.3g}" for t in ticks]),
        hovertemplate=f"link %{{y}}<br>step %{{x}}<br>{spec.label}: %{{customdata:.4g}}"
                      "<extra>click: open in timeline</extra>",
    ))
    for mark in view.marks:
        color = MARK_COLORS.get(mark.finding.kind, "#000")
        for top, bottom in _runs(mark.rows):
            for first, last in mark.spans:
                fig.add_shape(type="rect", x0=first - 0.5, x1=last + 0.5, y0=top - 0.5, y1=bottom + 0.5,
                              line=dict(color=color, width=3), fillcolor="rgba(0,0,0,0)", name=mark.finding.kind)
        fig.add_annotation(x=mark.spans[0][0] - 0.5, y=mark.rows[0] - 0.5, xanchor="left", yanchor="bottom",
                           text=mark.finding.kind, showarrow=False, font=dict(color=color, size=11))
    fig.update_layout(template=FIGURE_TEMPLATE, margin=FIGURE_MARGIN,
                      height=max(320, min(900, 22 * len(view.rows) + 140)),
                      xaxis=dict(title="step", type="category"),
                      yaxis=dict(title="link (host pair · ranks)", type="category", autorange="reversed"))
    return fig


def clicked_link(click_data: dict | None) -> tuple[int, tuple[int, int]] | None:
    """(step, (a, b)) of a clicked cell, None when nothing usable was clicked (plotly.js passes a
    heatmap's labels, not its customdata, in click events)."""
    if not click_data or not click_data.get("points"):
        return None
    point = click_data["points"][0]
    step = leading_int(point.get("x"))
    match = _LINK.search(str(point.get("y", "")))
    if step < 0 or match is None:
        return None
    return step, (int(match.group(1)), int(match.group(2)))


def timeline_href(run_index: int, step: int, link: tuple[int, int]) -> str:
    """The timeline at a step, on the two ends of a link."""
    return "/timeline?" + urlencode({"run": run_index, "step": step, "ranks": f"{link[0]},{link[1]}", "view": "ranks"})


def _log_scale(values: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """log10 of the values for the colors, and round ticks (1, 2, 5 x 10^k) over their range. A link's
    times and rates span decades (a throttled link, measured on the fault lab's 8 mbit tbf run: waits
    0.035 -> 0.49 s, rates 9.0e6 -> 6.3e5 B/s; the box's own noise reached 0.23 s): on a linear scale
    a few long stalls take the whole color range, and clipping it (the heatmap's color_range) saturated
    every episode and much of the noise alike. Zero (no wait at all) takes the lowest color."""
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size == 0:
        return np.where(np.isfinite(values), 0.0, np.nan), [1.0]
    lo, hi = float(positive.min()), float(positive.max())
    with np.errstate(invalid="ignore"):
        shown = np.log10(np.where(np.isfinite(values), np.maximum(values, lo), np.nan))
    ticks = [m * 10.0 ** k for k in range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
             for m in (1, 2, 5) if lo <= m * 10.0 ** k <= hi]
    return shown, ticks or [lo, hi]


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted row indices as (first, last) runs of adjacent rows."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out
