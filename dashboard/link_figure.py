"""The link x step heatmap from an analyzer LinkMap, the network findings outlined on it, and click decoding.

Rows are p2p links grouped by host pair (the analyzer folds them to at most max_rows in DuckDB); a
network finding is drawn as an outline over the rows of its links and the columns of its episodes. A
click is decoded from the cell's labels (step, and the row's first link) to open the timeline there.
"""

from __future__ import annotations

import re
from urllib.parse import urlencode

import plotly.graph_objects as go

from megascope.analyzer.views.heatmap import color_range
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
        return empty_figure("No p2p transfers recorded (a run without pipeline stages has no links)")
    spec = LINK_METRICS[metric]
    zmin, zmax, clipped = color_range(values, spec.higher_is_worse)
    fig = go.Figure(go.Heatmap(
        z=values, x=[str(c) for c in view.cols], y=view.rows, zmin=zmin, zmax=zmax,
        colorscale="YlOrRd" if spec.higher_is_worse else "YlOrRd_r",
        colorbar=dict(title=spec.label + ("<br>(outliers clipped)" if clipped else "")),
        hovertemplate=f"link %{{y}}<br>step %{{x}}<br>{spec.label}: %{{z:.4g}}"
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


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted row indices as (first, last) runs of adjacent rows."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out
