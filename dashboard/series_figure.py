"""Line figures over steps or time: MFU and step time, run comparison, GPU samples."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from megascope.dashboard.widgets import FIGURE_MARGIN, FIGURE_TEMPLATE, empty_figure

_WEBGL_POINTS = 2000  # above this many points per figure, draw with WebGL


def mfu_figure(per_step: pd.DataFrame) -> go.Figure:
    """MFU(%) and step time(s) over steps, two stacked panels sharing the step axis."""
    if per_step.empty:
        return empty_figure("No steps recorded yet")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    fig.add_trace(go.Scatter(x=per_step["step"], y=per_step["mfu"] * 100, name="MFU(%)",
                             mode="lines+markers"), row=1, col=1)
    fig.add_trace(go.Scatter(x=per_step["step"], y=per_step["step_time_s"], name="step_time(s)",
                             mode="lines+markers"), row=2, col=1)
    fig.update_yaxes(title_text="MFU(%)", row=1, col=1)
    fig.update_yaxes(title_text="step_time(s)", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(template=FIGURE_TEMPLATE, margin=FIGURE_MARGIN, height=420, showlegend=False)
    return fig


def comparison_figure(per_step_by_run: dict[str, pd.DataFrame], column: str, title: str) -> go.Figure:
    """One line per run of a per-step column (step_time_s or mfu) over steps."""
    fig = go.Figure()
    scale = 100.0 if column == "mfu" else 1.0
    for name, per_step in per_step_by_run.items():
        if per_step.empty:
            continue
        fig.add_trace(go.Scatter(x=per_step["step"], y=per_step[column] * scale, name=name,
                                 mode="lines+markers"))
    if not fig.data:
        return empty_figure("None of the open runs has steps yet")
    fig.update_layout(template=FIGURE_TEMPLATE, margin=FIGURE_MARGIN, height=360, title=title,
                      xaxis_title="step", yaxis_title=title, legend=dict(orientation="h", y=-0.2))
    return fig


def gpu_figure(samples: pd.DataFrame, column: str, max_lines: int = 64) -> go.Figure:
    """A GPU metric over time: one line per rank, or min/median/max across ranks for big jobs."""
    if samples.empty:
        return empty_figure("This run has no GPU samples (CPU run, or NVML unavailable)")
    t0 = samples["ts_ns"].min()
    frame = samples.assign(t_s=(samples["ts_ns"] - t0) / 1e9)
    fig = go.Figure()
    if frame["rank"].nunique() <= max_lines:
        scatter = go.Scattergl if len(frame) > _WEBGL_POINTS else go.Scatter
        for rank, rows in frame.groupby("rank"):
            fig.add_trace(scatter(x=rows["t_s"], y=rows[column], name=f"rank {rank}", mode="lines"))
    else:
        frame["t_bin"] = frame["t_s"].round(0)
        band = frame.groupby("t_bin")[column].agg(["min", "median", "max"]).reset_index()
        for stat in ("max", "median", "min"):
            fig.add_trace(go.Scatter(x=band["t_bin"], y=band[stat], name=f"{stat} over ranks", mode="lines"))
    fig.update_layout(template=FIGURE_TEMPLATE, margin=FIGURE_MARGIN, height=380,
                      xaxis_title="time since first sample (s)", yaxis_title=column)
    return fig
