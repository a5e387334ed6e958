"""Heatmap (MegaScale Fig. 7): rank x step colored by a metric; a click opens the step in the timeline."""

from __future__ import annotations

from urllib.parse import urlencode

import dash
from dash import Input, Output, State, callback, dcc, html

from megascope.dashboard import ids
from megascope.dashboard.heatmap_figure import GROUPINGS, METRICS, clicked_cell, heatmap_figure, ordered_rows
from megascope.dashboard.runs import current_catalog

dash.register_page(__name__, path="/heatmap", name="Heatmap", order=1, title="megascope: heatmap")

MAX_ROWS = 512  # cells the browser gets at most; the analyzer aggregates down to this in DuckDB
MAX_COLS = 500
_ORDERS = {"rank": "rank", "pp": "stage first", "dp": "replica first", "tp": "tp rank first", "host": "host"}


def layout(metric: str = "compute", group_by: str = "rank", **_query: str) -> html.Div:
    metric = metric if metric in METRICS else "compute"
    group_by = group_by if group_by in GROUPINGS else "rank"
    return html.Div([
        html.H2("Heatmap: rank x step"),
        html.Div(className="controls", children=[
            html.Label(["metric", dcc.Dropdown(id=ids.HEATMAP_METRIC, value=metric, clearable=False,
                                               options=[{"label": v, "value": k} for k, v in METRICS.items()])]),
            html.Label(["rows", dcc.RadioItems(id=ids.HEATMAP_GROUP, value=group_by, inline=True,
                                               options=[{"label": v, "value": k} for k, v in GROUPINGS.items()])]),
            html.Label(["order ranks by", dcc.RadioItems(
                id=ids.HEATMAP_ORDER, value="rank", inline=True,
                options=[{"label": v, "value": k} for k, v in _ORDERS.items()])]),
        ]),
        html.P("Click a cell to open that step in the timeline.", className="muted"),
        dcc.Loading(dcc.Graph(id=ids.HEATMAP_GRAPH, config={"displaylogo": False})),
    ])


@callback(Output(ids.HEATMAP_GRAPH, "figure"), Input(ids.HEATMAP_METRIC, "value"), Input(ids.HEATMAP_GROUP, "value"),
          Input(ids.HEATMAP_ORDER, "value"), Input(ids.APP_RUN, "value"), Input(ids.APP_INTERVAL, "n_intervals"))
def update_heatmap(metric: str, group_by: str, order: str, run_value: int | None, _tick: int | None):
    metric = metric if metric in METRICS else "compute"
    group_by = group_by if group_by in GROUPINGS else "rank"
    catalog = current_catalog()
    return catalog.cached(run_value, ("heatmap", metric, group_by, order), lambda run: heatmap_figure(
        ordered_rows(run.heatmap(metric, group_by=group_by, max_rows=MAX_ROWS, max_cols=MAX_COLS),
                     run.topology, order if group_by == "rank" else "rank"), metric, group_by))


@callback(Output(ids.APP_URL, "href", allow_duplicate=True), Input(ids.HEATMAP_GRAPH, "clickData"),
          State(ids.HEATMAP_GROUP, "value"), State(ids.APP_RUN, "value"), prevent_initial_call=True)
def open_in_timeline(click_data: dict | None, group_by: str | None, run_value: int | None):
    """A clicked cell -> the timeline at that step (and that rank, with its pipeline group)."""
    cell = clicked_cell(click_data, group_by or "rank")
    if cell is None:
        return dash.no_update
    step, rank = cell
    query: dict[str, object] = {"run": current_catalog().index(run_value), "step": step}
    if rank is not None:
        query.update(ranks=rank, view="pp")
    return f"/timeline?{urlencode(query)}"
