"""The 3D topology view (MegaScale section 5.2): pipeline stages down, dp x tp replicas across
(dp x cp x tp with context parallelism: columns 'dp0·cp1·tp0'; runs without cp keep 'dp0·tp0').

Every cell is one rank; color is a per-rank value (a metric averaged over steps, or the severity of
the worst finding that names the rank). Hang suspects are marked with a red X so the ranks everyone
waits on stand out; ranks flagged by incidents (dead, silent, stalled) or self-checks carry a purple
diamond with the reasons in its hover text."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from megascope.dashboard.widgets import FIGURE_MARGIN, FIGURE_TEMPLATE, empty_figure

_COLUMN = re.compile(r"dp(\d+)(?:·cp(\d+))?·tp(\d+)")
_STAGE = re.compile(r"stage (\d+)")


def topology_figure(topology: pd.DataFrame, values: dict[int, float], color_title: str,
                    suspects: list[int] | None = None, selected: int | None = None,
                    flagged: dict[int, list[str]] | None = None) -> go.Figure:
    """A pp x (dp, cp, tp) grid of ranks colored by values[rank] (missing ranks are blank)."""
    if topology.empty:
        return empty_figure("run.json has no topology")
    topo = _with_cp(topology).sort_values(["pp", "dp", "cp", "tp"])
    tp_size = int(topo["tp"].max()) + 1
    cp_size = int(topo["cp"].max()) + 1
    n_cols = (int(topo["dp"].max()) + 1) * cp_size * tp_size
    n_rows = int(topo["pp"].max()) + 1
    z = np.full((n_rows, n_cols), np.nan)
    ranks = np.full((n_rows, n_cols), -1)
    hover = np.full((n_rows, n_cols), "", dtype=object)
    text = np.full((n_rows, n_cols), "", dtype=object)
    for r in topo.itertuples(index=False):
        col = (int(r.dp) * cp_size + int(r.cp)) * tp_size + int(r.tp)
        z[r.pp, col] = values.get(int(r.rank), np.nan)
        ranks[r.pp, col] = int(r.rank)
        text[r.pp, col] = str(r.rank)
        cp = f" cp {r.cp}" if cp_size > 1 else ""
        hover[r.pp, col] = f"rank {r.rank}<br>pp {r.pp} dp {r.dp}{cp} tp {r.tp}<br>host {r.host}"
    x_labels = [_column(d, c, t, cp_size) for d in range(n_cols // (cp_size * tp_size))
                for c in range(cp_size) for t in range(tp_size)]
    y_labels = [f"stage {p}" for p in range(n_rows)]
    fig = go.Figure(go.Heatmap(
        z=z, x=x_labels, y=y_labels, customdata=ranks, hovertext=hover, colorscale="YlOrRd", xgap=2, ygap=2,
        colorbar=dict(title=color_title), hovertemplate="%{hovertext}<br>" + color_title + ": %{z:.4g}<extra></extra>",
        text=text, texttemplate="%{text}" if ranks.size <= 1024 else None,
    ))
    _mark(fig, topo, cp_size, suspects or [], "hang suspect", dict(symbol="x", size=18, color="#B00"))
    if flagged:
        _mark(fig, topo, cp_size, list(flagged), "incident / self-check",
              dict(symbol="diamond-open", size=22, color="#7B2CBF", line=dict(width=3)),
              {r: "<br>".join(reasons) for r, reasons in flagged.items()})
    if selected is not None:
        _mark(fig, topo, cp_size, [selected], "selected",
              dict(symbol="square-open", size=26, color="#000", line=dict(width=3)))
    fig.update_layout(template=FIGURE_TEMPLATE, margin=FIGURE_MARGIN, height=max(260, 70 * n_rows + 140),
                      xaxis=dict(title="data-parallel replica · " + ("context-parallel rank · " if cp_size > 1 else "")
                                 + "tensor-parallel rank", type="category"),
                      yaxis=dict(title="pipeline stage", type="category", autorange="reversed"),
                      legend=dict(orientation="h", y=1.02, yanchor="bottom"))
    return fig


def _with_cp(topology: pd.DataFrame) -> pd.DataFrame:
    """The topology with a cp column (0 where run.json has none: the trainer, older runs)."""
    return topology if "cp" in topology else topology.assign(cp=0)


def _column(dp: int, cp: int, tp: int, cp_size: int) -> str:
    return f"dp{dp}·cp{cp}·tp{tp}" if cp_size > 1 else f"dp{dp}·tp{tp}"


def _mark(fig: go.Figure, topo: pd.DataFrame, cp_size: int, ranks: list[int], name: str, marker: dict,
          why: dict[int, str] | None = None) -> None:
    rows = topo[topo["rank"].isin(ranks)]
    if rows.empty:
        return
    text = [(why or {}).get(int(r), "") for r in rows["rank"]]
    fig.add_trace(go.Scatter(
        x=[_column(d, c, t, cp_size) for d, c, t in zip(rows["dp"], rows["cp"], rows["tp"])],
        y=[f"stage {p}" for p in rows["pp"]],
        mode="markers", name=name, marker=marker, customdata=rows["rank"], text=text,
        hovertemplate=f"{name}: rank %{{customdata}}" + ("<br>%{text}" if why else "") + "<extra></extra>"))


def clicked_rank(click_data: dict | None, topology: pd.DataFrame) -> int | None:
    """The rank of a clicked cell or marker, decoded from its 'dp0·tp1' (or 'dp0·cp1·tp0') / 'stage 1'
    labels (plotly.js does not pass a heatmap's customdata in click events)."""
    if not click_data or not click_data.get("points"):
        return None
    point = click_data["points"][0]
    column = _COLUMN.fullmatch(str(point.get("x", "")))
    stage = _STAGE.fullmatch(str(point.get("y", "")))
    if not column or not stage:
        return None
    dp, cp, tp, pp = int(column.group(1)), int(column.group(2) or 0), int(column.group(3)), int(stage.group(1))
    topo = _with_cp(topology)
    match = topo[(topo["dp"] == dp) & (topo["cp"] == cp) & (topo["tp"] == tp) & (topo["pp"] == pp)]
    return int(match.iloc[0]["rank"]) if not match.empty else None
