"""Run comparison: step time and MFU of every open run side by side."""

from __future__ import annotations

from functools import partial

import dash
from dash import Input, Output, callback, dcc, html

from megascope.analyzer import Run
from megascope.dashboard import ids
from megascope.dashboard.runs import current_catalog
from megascope.dashboard.series_figure import comparison_figure
from megascope.dashboard.widgets import notices

dash.register_page(__name__, path="/compare", name="Compare runs", order=6, title="megascope: compare runs")


def layout(**_query: str) -> html.Div:
    return html.Div([
        html.H2("Compare runs"),
        html.Div(id=ids.COMPARE_NOTICES),
        html.Div(className="row", children=[
            html.Div(dcc.Graph(id=ids.COMPARE_STEP_TIME, config={"displaylogo": False}), className="panel panel-half"),
            html.Div(dcc.Graph(id=ids.COMPARE_MFU, config={"displaylogo": False}), className="panel panel-half"),
        ]),
        html.Div(id=ids.COMPARE_SUMMARY, className="panel"),
    ])


@callback(Output(ids.COMPARE_STEP_TIME, "figure"), Output(ids.COMPARE_MFU, "figure"),
          Output(ids.COMPARE_SUMMARY, "children"), Output(ids.COMPARE_NOTICES, "children"),
          Input(ids.APP_INTERVAL, "n_intervals"))
def update_comparison(_tick: int | None):
    catalog = current_catalog()
    per_step = {name: catalog.cached(i, ("mfu-per-step",), lambda run: run.mfu().per_step)
                for i, name in enumerate(catalog.names)}
    rows = [catalog.cached(i, ("compare-row",), partial(summary_row, name=name))
            for i, name in enumerate(catalog.names)]
    hint = [] if len(catalog) > 1 else ["Only one run is open: start with `megascope dashboard RUN_A RUN_B ...` "
                                        "to compare runs."]
    table = html.Table([html.Tr([html.Th(h) for h in ("run", "dp x pp x tp", "steps", "mean step_time(s)",
                                                      "mean MFU(%)", "findings")])] +
                       [html.Tr([html.Td(v) for v in row]) for row in rows], className="grid", id=ids.COMPARE_TABLE)
    return (comparison_figure(per_step, "step_time_s", "step_time(s)"),
            comparison_figure(per_step, "mfu", "MFU(%)"), table, notices(hint, "info"))


def summary_row(run: Run, name: str) -> list[str]:
    timeline = run.mfu()
    topo = run.manifest.get("topology", {})
    mean_time = timeline.per_step["step_time_s"].mean() if not timeline.per_step.empty else float("nan")
    mean_mfu = timeline.mean if timeline.mean is not None else float("nan")
    return [name, f"{topo.get('dp', '?')} x {topo.get('pp', '?')} x {topo.get('tp', '?')}",
            str(len(timeline.per_step)), f"{mean_time:.4g}", f"{100 * mean_mfu:.2f}", str(len(run.findings()))]
