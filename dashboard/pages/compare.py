"""Run comparison: step time and MFU of every open run side by side, and what changed from the first run
to each other one (the analyzer's run diff: the changes beyond the runs' own noise, findings that
appeared or went away)."""

from __future__ import annotations

from functools import partial

import dash
from dash import Input, Output, callback, dcc, html

from megascope.analyzer import Run
from megascope.analyzer.views.run_diff import DiffInputError, diff, finding_text
from megascope.dashboard import ids
from megascope.dashboard.runs import RunCatalog, current_catalog, directory_signature
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
            comparison_figure(per_step, "mfu", "MFU(%)"), html.Div([table, *changes_from_first(catalog)]),
            notices(hint, "info"))


def changes_from_first(catalog: RunCatalog) -> list[html.Div]:
    """Per run after the first: what changed from the first run to it (`megascope diff FIRST RUN`)."""
    first = directory_signature(catalog.paths[0])
    return [catalog.cached(i, ("diff-from-first", first), partial(_changes, catalog=catalog, name=name))
            for i, name in enumerate(catalog.names) if i]


def _changes(run_b: Run, catalog: RunCatalog, name: str) -> html.Div:
    a = catalog.names[0]
    with catalog.using(0) as run_a:  # run_b's lock is held by catalog.cached: locks taken in this order only
        try:
            d = diff(run_a, run_b)
        except DiffInputError as exc:
            return html.Div([html.H3(f"{a} -> {name}"), html.P(str(exc))])
    lines = [c.sentence(a, name) for c in d.named] or ["nothing beyond the runs' own step-to-step noise"]
    lines += [f"appeared: {finding_text(f)}" for f in d.appeared]
    lines += [f"went away: {finding_text(f)}" for f in d.went_away]
    lines += [f"not compared: {note}" for note in d.not_compared]
    return html.Div([html.H3(f"{a} -> {name}"), html.Ul([html.Li(line) for line in lines])])


def summary_row(run: Run, name: str) -> list[str]:
    timeline = run.mfu()
    topo = run.manifest.get("topology", {})
    mean_time = timeline.per_step["step_time_s"].mean() if not timeline.per_step.empty else float("nan")
    mean_mfu = timeline.mean if timeline.mean is not None else float("nan")
    return [name, f"{topo.get('dp', '?')} x {topo.get('pp', '?')} x {topo.get('tp', '?')}",
            str(len(timeline.per_step)), f"{mean_time:.4g}", f"{100 * mean_mfu:.2f}", str(len(run.findings()))]
