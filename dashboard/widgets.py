"""Small Dash components shared by the pages: notices, placeholder figures, key-value tables."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from dash import html

FIGURE_MARGIN = dict(l=60, r=20, t=40, b=40)
FIGURE_TEMPLATE = "plotly_white"


def notices(messages: list[str], kind: str = "warning") -> html.Div:
    """A list of messages (what is missing, what went wrong); empty when there is nothing to say."""
    return html.Div([html.Div(m, className=f"notice notice-{kind}") for m in messages],
                    className="notices")


def empty_figure(message: str) -> go.Figure:
    """A blank figure that says why it is blank (no steps yet, no GPU samples, ...)."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font=dict(size=15, color="#666"),
                       xref="paper", yref="paper", x=0.5, y=0.5)
    fig.update_layout(template=FIGURE_TEMPLATE, margin=FIGURE_MARGIN, height=320,
                      xaxis=dict(visible=False), yaxis=dict(visible=False))
    return fig


def key_values(rows: list[tuple[str, Any]], class_name: str = "kv") -> html.Table:
    """A two-column table of labels and values."""
    return html.Table([html.Tr([html.Th(k), html.Td(_fmt(v))]) for k, v in rows], className=class_name)


def data_table(frame: pd.DataFrame, class_name: str = "grid", max_rows: int = 200) -> html.Table:
    """A plain HTML table of a small DataFrame (first max_rows rows)."""
    head = html.Thead(html.Tr([html.Th(c) for c in frame.columns]))
    body = html.Tbody([html.Tr([html.Td(_fmt(v)) for v in row])
                       for row in frame.head(max_rows).itertuples(index=False)])
    return html.Table([head, body], className=class_name)


def _fmt(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return value
