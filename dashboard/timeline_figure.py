"""The cross-rank timeline (MegaScale Fig. 8): events of a few ranks on one aligned time axis.

One row per rank; compute, collectives and p2p sit in lanes within the row so overlapped
communication stays visible. Dependency arrows join p2p send->recv and collective members; a
selected event outlines what it waited on (blue) and what waited on it (green); the critical path
is outlined in red. Bars are Plotly bars up to a few thousand events, WebGL segments beyond.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from megascope.dashboard.widgets import FIGURE_MARGIN, FIGURE_TEMPLATE, empty_figure

KIND_COLORS = {"compute": "#4C78A8", "collective": "#F58518", "p2p": "#54A24B", "host": "#9D755D"}
_LANE = {"compute": -0.22, "host": -0.22, "collective": 0.0, "p2p": 0.22}
_BAR_WIDTH = 0.2
_WEBGL_EVENTS = 4000
_ARROW_KINDS = ("p2p", "collective")


@dataclass
class Highlight:
    """Events to outline: the selection, its predecessors and successors, the critical path."""
    selected: int | None = None
    waited_on: set[int] = field(default_factory=set)
    waited_by: set[int] = field(default_factory=set)
    critical: list[int] = field(default_factory=list)


def related_events(deps: pd.DataFrame, event_id: int) -> tuple[set[int], set[int]]:
    """(events the given one waited on, events that waited on it) from the dependency edges."""
    if deps.empty:
        return set(), set()
    waited_on = set(int(e) for e in deps.loc[deps["dst_event_id"] == event_id, "src_event_id"])
    waited_by = set(int(e) for e in deps.loc[deps["src_event_id"] == event_id, "dst_event_id"])
    return waited_on, waited_by


def timeline_figure(events: pd.DataFrame, deps: pd.DataFrame, row_labels: dict[int, str],
                    highlight: Highlight | None = None) -> go.Figure:
    """Figure of events (analyzer.events columns) of the ranks in row_labels (rank -> label)."""
    if events.empty:
        return empty_figure("No events for these ranks and steps (not traced, or not written yet)")
    highlight = highlight or Highlight()
    frame = _placed(events, list(row_labels))
    fig = go.Figure()
    draw = _add_bars if len(frame) <= _WEBGL_EVENTS else _add_segments
    for kind, rows in frame.groupby("kind", sort=False):
        draw(fig, rows, kind)
    _add_arrows(fig, frame, deps)
    _add_outlines(fig, frame, highlight)
    ranks = list(row_labels)
    fig.update_layout(
        template=FIGURE_TEMPLATE, margin=dict(FIGURE_MARGIN, l=150), barmode="overlay",
        height=max(300, 60 * len(ranks) + 120), clickmode="event",
        xaxis=dict(title="time since the step began on the earliest rank (ms)"),
        yaxis=dict(tickvals=list(range(len(ranks))), ticktext=[row_labels[r] for r in ranks],
                   autorange="reversed", zeroline=False),
        legend=dict(orientation="h", y=1.02, yanchor="bottom"),
    )
    return fig


def _placed(events: pd.DataFrame, ranks: list[int]) -> pd.DataFrame:
    """Events with y (row + lane) and start/end in ms from the earliest start."""
    row_of = {r: i for i, r in enumerate(ranks)}
    frame = events[events["rank"].isin(row_of)].copy()
    t0 = frame["start_ns"].min()
    frame["t0_ms"] = (frame["start_ns"] - t0) / 1e6
    frame["t1_ms"] = (frame["end_ns"] - t0) / 1e6
    frame["y"] = frame["rank"].map(row_of) + frame["kind"].map(_LANE).fillna(0.0)
    frame["label"] = (frame["name"] + " [" + frame["kind"] + " " + frame["group"].fillna("") +
                      "] step " + frame["step"].astype(str) + " mb " + frame["microbatch"].astype(str))
    return frame


def _add_bars(fig: go.Figure, rows: pd.DataFrame, kind: str) -> None:
    fig.add_trace(go.Bar(
        orientation="h", y=rows["y"], base=rows["t0_ms"], x=rows["t1_ms"] - rows["t0_ms"], width=_BAR_WIDTH,
        name=kind, marker_color=KIND_COLORS.get(kind, "#888"), customdata=rows["event_id"],
        text=rows["label"], textposition="none",
        hovertemplate="%{text}<br>%{base:.3f} ms + %{x:.3f} ms<extra>click: dependencies</extra>",
    ))


def _add_segments(fig: go.Figure, rows: pd.DataFrame, kind: str) -> None:
    """WebGL: each event a thick horizontal segment (NaN-separated), clickable at both ends."""
    n = len(rows)
    xs = np.column_stack([rows["t0_ms"], rows["t1_ms"], np.full(n, np.nan)]).ravel()
    ys = np.column_stack([rows["y"], rows["y"], np.full(n, np.nan)]).ravel()
    ids = np.column_stack([rows["event_id"], rows["event_id"], np.full(n, -1)]).ravel()
    text = np.repeat(rows["label"].to_numpy(), 3)
    fig.add_trace(go.Scattergl(x=xs, y=ys, mode="lines", name=kind, customdata=ids, text=text,
                               line=dict(color=KIND_COLORS.get(kind, "#888"), width=7),
                               hovertemplate="%{text}<extra></extra>"))


def _add_arrows(fig: go.Figure, frame: pd.DataFrame, deps: pd.DataFrame) -> None:
    """Arrows from the end of each cross-rank dependency's source to the end of its target."""
    if deps.empty:
        return
    cross = deps[deps["kind"].isin(_ARROW_KINDS)]
    ends = frame[["event_id", "t1_ms", "y"]]
    cross = (cross.merge(ends.rename(columns={"event_id": "src_event_id"}), on="src_event_id")
             .merge(ends.rename(columns={"event_id": "dst_event_id"}), on="dst_event_id", suffixes=("", "_dst")))
    if cross.empty:
        return
    n = len(cross)
    xs = np.column_stack([cross["t1_ms"], cross["t1_ms_dst"], np.full(n, np.nan)]).ravel()
    ys = np.column_stack([cross["y"], cross["y_dst"], np.full(n, np.nan)]).ravel()
    sizes = np.tile([0, 9, 0], n)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name="dependency", hoverinfo="skip",
                             line=dict(color="rgba(80,80,80,0.45)", width=1),
                             marker=dict(symbol="arrow", angleref="previous", size=sizes,
                                         color="rgba(80,80,80,0.8)")))


def _add_outlines(fig: go.Figure, frame: pd.DataFrame, highlight: Highlight) -> None:
    groups = [("critical path", highlight.critical, "#D62728", 2.5),
              ("waited on", highlight.waited_on, "#1F77B4", 3),
              ("waited on it", highlight.waited_by, "#2CA02C", 3),
              ("selected", [highlight.selected] if highlight.selected is not None else [], "#000", 3.5)]
    for name, ids, color, width in groups:
        rows = frame[frame["event_id"].isin(list(ids))]
        if rows.empty:
            continue
        fig.add_trace(go.Bar(
            orientation="h", y=rows["y"], base=rows["t0_ms"], x=(rows["t1_ms"] - rows["t0_ms"]).clip(lower=1e-3),
            width=_BAR_WIDTH + 0.08, name=name, customdata=rows["event_id"], text=rows["label"],
            textposition="none", hovertemplate=f"{name}: %{{text}}<extra></extra>",
            marker=dict(color="rgba(0,0,0,0)", line=dict(color=color, width=width)),
        ))
