"""Topology (MegaScale 5.2): the dp x pp x tp grid of ranks; select one to see where it sits and talks."""

from __future__ import annotations

import re

import dash
import numpy as np
import pandas as pd
from dash import Input, Output, State, callback, dcc, html
from dash.development.base_component import Component

from megascope.analyzer import Run
from megascope.dashboard import ids
from megascope.dashboard.heatmap_figure import METRICS, leading_int
from megascope.dashboard.incidents_view import flagged_ranks
from megascope.dashboard.rank_groups import rank_label, rank_neighbours
from megascope.dashboard.runs import current_catalog
from megascope.dashboard.topology_figure import clicked_rank, topology_figure
from megascope.dashboard.widgets import data_table, key_values, notices

dash.register_page(__name__, path="/topology", name="Topology", order=4, title="megascope: topology")

_COLORS = {**{k: f"{v}, median over steps" for k, v in METRICS.items()}, "findings": "worst finding (severity)"}


def layout(color: str = "step_time", ranks: str | None = None, **_query: str) -> html.Div:
    first = leading_int((ranks or "").split(",")[0]) if ranks else -1
    return html.Div([
        html.H2("Topology: pipeline stages x data-parallel replicas x tensor-parallel ranks"),
        html.Div(className="controls", children=[
            html.Label(["color by", dcc.Dropdown(
                id=ids.TOPOLOGY_COLOR, value=color if color in _COLORS else "step_time", clearable=False,
                options=[{"label": v, "value": k} for k, v in _COLORS.items()])]),
        ]),
        html.Div(id=ids.TOPOLOGY_HANG),
        dcc.Store(id=ids.TOPOLOGY_RANK, data=first if first >= 0 else None),
        dcc.Loading(dcc.Graph(id=ids.TOPOLOGY_GRAPH, config={"displaylogo": False})),
        html.Div(id=ids.TOPOLOGY_DETAILS, className="panel"),
    ])


@callback(Output(ids.TOPOLOGY_RANK, "data"), Input(ids.TOPOLOGY_GRAPH, "clickData"), State(ids.APP_RUN, "value"),
          prevent_initial_call=True)
def select_rank(click_data: dict | None, run_value: int | None):
    topology = current_catalog().cached(run_value, ("topology",), lambda run: run.topology)
    rank = clicked_rank(click_data, topology)
    return dash.no_update if rank is None else rank


@callback(Output(ids.TOPOLOGY_GRAPH, "figure"), Output(ids.TOPOLOGY_HANG, "children"),
          Input(ids.TOPOLOGY_COLOR, "value"), Input(ids.TOPOLOGY_RANK, "data"),
          Input(ids.APP_RUN, "value"), Input(ids.APP_INTERVAL, "n_intervals"))
def update_grid(color: str, selected: int | None, run_value: int | None, _tick: int | None):
    color = color if color in _COLORS else "step_time"
    return current_catalog().cached(run_value, ("topology-grid", color, selected),
                                    lambda run: render_grid(run, color, selected))


@callback(Output(ids.TOPOLOGY_DETAILS, "children"), Input(ids.TOPOLOGY_RANK, "data"),
          Input(ids.APP_RUN, "value"), Input(ids.APP_INTERVAL, "n_intervals"))
def update_details(selected: int | None, run_value: int | None, _tick: int | None):
    if selected is None:
        return html.P("Click a rank to see its position, data flow, peers, in-flight record and errors.",
                      className="muted")
    return current_catalog().cached(run_value, ("topology-rank", int(selected)),
                                    lambda run: rank_details(run, int(selected)))


def render_grid(run: Run, color: str, selected: int | None):
    hang = run.hang()
    suspects = [int(r) for r in hang.suspects] if hang is not None else []
    values = finding_severity(run) if color == "findings" else metric_by_rank(run, color)
    flagged = flagged_ranks(run)
    figure = topology_figure(run.topology, values, _COLORS[color], suspects, selected, flagged)
    messages = [f"Hang: {hang.summary} Suspects (the ranks everyone waits on): {suspects}."] if hang is not None else []
    if flagged:
        messages.append(f"Ranks flagged by incidents or self-checks (marked with a diamond): {sorted(flagged)}.")
    return figure, notices(messages, "error")


def metric_by_rank(run: Run, metric: str, max_cols: int = 64) -> dict[int, float]:
    """The metric per rank, the median over steps (over step bins of the analyzer's heatmap on long
    runs): robust to the warm-up step and restarts, which would otherwise color every rank alike."""
    heatmap = run.heatmap(metric, group_by="rank", max_rows=max(1, len(run.topology)), max_cols=max_cols)
    values: dict[int, float] = {}
    for label, row in zip(heatmap.rows, heatmap.values):
        finite = np.asarray(row, dtype=float)
        finite = finite[np.isfinite(finite)]
        if finite.size:
            values[leading_int(label)] = float(np.median(finite))
    return values


def finding_severity(run: Run) -> dict[int, float]:
    """Per rank, the severity of the worst finding naming it."""
    worst: dict[int, float] = {}
    for finding in run.findings():
        for rank in finding.ranks or []:
            worst[int(rank)] = max(worst.get(int(rank), 0.0), float(finding.severity or 0.0))
    return worst


def rank_details(run: Run, rank: int) -> Component:
    """Position, data flow, peers, what the rank ran last step, in-flight record and errors."""
    topo = run.topology
    me = topo[topo["rank"] == rank]
    if me.empty:
        return html.P(f"rank {rank} is not in this run's topology.", className="muted")
    row = me.iloc[0]
    position = [("rank", rank), ("pipeline stage (pp)", row["pp"]), ("data-parallel replica (dp)", row["dp"]),
                ("tensor-parallel rank (tp)", row["tp"]), ("host", row["host"]), ("local rank", row["local_rank"])]
    if "cp" in topo and topo["cp"].max() > 0:  # context-parallel runs only; others have no cp coordinate
        position.insert(3, ("context-parallel rank (cp)", row["cp"]))
    flow = [(k, v or "none") for k, v in rank_neighbours(topo, rank).items()]
    flow.append(("gradients", "flow backward: from the next stage to the previous one"))
    return html.Div(id=ids.TOPOLOGY_RANK_DETAILS, children=[
        html.H3(f"{rank_label(topo, rank)}"),
        html.Div(className="row", children=[
            html.Div([html.H4("position"), key_values(position)], className="panel-narrow"),
            html.Div([html.H4("data flow and peers"), key_values(flow)], className="panel-wide"),
        ]),
        html.H4("collectives and transfers in the latest step"), collectives_table(run, rank),
        html.H4("in-flight record and errors"), notices(rank_problems(run, rank), "error"),
    ])


def collectives_table(run: Run, rank: int) -> Component:
    steps = run.steps()
    if steps.empty:
        return html.P("No steps recorded yet.", className="muted")
    last = int(steps["step"].max())
    events = run.events(steps=(last, last), ranks=[rank])
    comm = events[events["kind"].isin(["collective", "p2p"])] if not events.empty else events
    if comm.empty:
        return html.P(f"No communication events from rank {rank} in step {last}.", className="muted")
    comm = comm.assign(time_ms=(comm["end_ns"] - comm["start_ns"]) / 1e6)
    table = comm.groupby(["group", "kind", "name"], as_index=False).agg(
        ops=("name", "size"), peers=("peer", lambda p: sorted({int(x) for x in p if x >= 0})),
        MB=("bytes", lambda b: b.sum() / 1e6), total_ms=("time_ms", "sum"))
    return data_table(pd.DataFrame(table))


def rank_problems(run: Run, rank: int) -> list[str]:
    """The hang record, findings, incidents, self-check verdicts and warnings that concern this rank."""
    problems: list[str] = []
    hang = run.hang()
    if hang is not None and rank in [int(r) for r in hang.suspects]:
        problems.append(f"hang suspect: {hang.summary}")
    elif hang is not None and rank in [int(r) for r in hang.waiting]:
        problems.append(f"in flight: waiting in {hang.op} since step {hang.step}: {hang.summary}")
    problems += [f"{f.kind} (steps {f.steps[0]}-{f.steps[1]}, severity {f.severity:.3g}): {f.summary}"
                 for f in run.findings() if rank in [int(r) for r in f.ranks or []]]
    problems += flagged_ranks(run).get(rank, [])
    mentions = re.compile(rf"\brank {rank}\b")
    problems += [w for w in run.warnings if mentions.search(w)]
    return problems or ["none: no hang record, finding or warning names this rank"]
