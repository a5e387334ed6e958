"""Timeline (MegaScale Fig. 8): the events of chosen ranks in one step, with dependency arrows."""

from __future__ import annotations

import dash
import pandas as pd
from dash import Input, Output, State, callback, dcc, html
from dash.development.base_component import Component

from megascope.analyzer import Run
from megascope.dashboard import ids
from megascope.dashboard.rank_groups import group_of_rank, rank_label
from megascope.dashboard.runs import current_catalog
from megascope.dashboard.timeline_figure import Highlight, related_events, timeline_figure
from megascope.dashboard.widgets import notices

dash.register_page(__name__, path="/timeline", name="Timeline", order=3, title="megascope: timeline")

MAX_ROWS = 32  # ranks on screen at once: a timeline is for reading, the heatmap is for scanning
_VIEWS = {"ranks": "chosen ranks", "pp": "their pipeline", "dp": "their data-parallel group",
          "tp": "their tensor-parallel group"}


def layout(step: str | None = None, ranks: str | None = None, view: str = "pp", **_query: str) -> html.Div:
    return html.Div([
        html.H2("Timeline"),
        html.Div(className="controls", children=[
            html.Label(["step", dcc.Input(id=ids.TIMELINE_STEP, type="number", min=0, step=1,
                                          value=_int_or_none(step), debounce=True)]),
            # options start with the linked ranks so the value survives until rank_options fills them in
            html.Label(["ranks", dcc.Dropdown(id=ids.TIMELINE_RANKS, multi=True, value=_ranks(ranks),
                                              options=[{"label": f"rank {r}", "value": r} for r in _ranks(ranks)],
                                              placeholder="rank 0")]),
            html.Label(["show", dcc.RadioItems(id=ids.TIMELINE_VIEW, value=view if view in _VIEWS else "pp",
                                               inline=True,
                                               options=[{"label": v, "value": k} for k, v in _VIEWS.items()])]),
            dcc.Checklist(id=ids.TIMELINE_CRITICAL, options=[{"label": " critical path", "value": "on"}], value=[]),
        ]),
        html.Div(id=ids.TIMELINE_NOTICES),
        dcc.Store(id=ids.TIMELINE_SELECTED),
        dcc.Store(id=ids.TIMELINE_FOLLOWED),
        dcc.Loading(dcc.Graph(id=ids.TIMELINE_GRAPH, config={"displaylogo": False})),
        html.Div(id=ids.TIMELINE_DETAILS, className="panel"),
    ])


@callback(Output(ids.TIMELINE_RANKS, "options"), Input(ids.APP_RUN, "value"))
def rank_options(run_value: int | None):
    topology = current_catalog().cached(run_value, ("topology",), lambda run: run.topology)
    return [{"label": rank_label(topology, int(r)), "value": int(r)} for r in topology["rank"]]


@callback(Output(ids.TIMELINE_STEP, "value"), Output(ids.TIMELINE_FOLLOWED, "data"),
          Input(ids.APP_RUN, "value"), Input(ids.APP_INTERVAL, "n_intervals"),
          State(ids.TIMELINE_STEP, "value"), State(ids.TIMELINE_FOLLOWED, "data"))
def follow_last_step(run_value: int | None, _tick: int | None, step: int | None, followed: int | None):
    """Fill an empty step box (the page opened without ?step=) with the run's last step, the one drawn,
    so the page says which step it shows, and move it on as a live run records more; a step the user
    gave (the link's, or typed) stays."""
    step = _int_or_none(step)
    if step is not None and step != followed:
        return dash.no_update, dash.no_update
    last = current_catalog().cached(run_value, ("last_step",), last_step)
    if last is None or last == step:
        return dash.no_update, dash.no_update
    return last, last


def last_step(run: Run) -> int | None:
    """The last step any rank recorded (None: none yet)."""
    steps = run.steps()
    return None if steps.empty else int(steps["step"].max())


@callback(Output(ids.TIMELINE_SELECTED, "data"), Input(ids.TIMELINE_GRAPH, "clickData"), prevent_initial_call=True)
def select_event(click_data: dict | None):
    """Remember the clicked event (customdata of bars is the event id; -1 marks gaps)."""
    if click_data is None:
        return None
    try:
        event_id = int(click_data["points"][0]["customdata"])
    except (TypeError, KeyError, IndexError, ValueError):
        return None
    return event_id if event_id >= 0 else None


@callback(Output(ids.TIMELINE_GRAPH, "figure"), Output(ids.TIMELINE_DETAILS, "children"),
          Output(ids.TIMELINE_NOTICES, "children"),
          Input(ids.TIMELINE_STEP, "value"), Input(ids.TIMELINE_RANKS, "value"), Input(ids.TIMELINE_VIEW, "value"),
          Input(ids.TIMELINE_CRITICAL, "value"), Input(ids.TIMELINE_SELECTED, "data"),
          Input(ids.APP_RUN, "value"), Input(ids.APP_INTERVAL, "n_intervals"))
def update_timeline(step, ranks, view, critical, selected, run_value, _tick):
    key = ("timeline", step, tuple(ranks or ()), view, bool(critical), selected)
    return current_catalog().cached(run_value, key, lambda run: render(
        run, _int_or_none(step), [int(r) for r in ranks or []], view, bool(critical), selected))


def render(run: Run, step: int | None, ranks: list[int], view: str, critical: bool, selected: int | None):
    """Figure, selection details and notices for one step of the chosen ranks."""
    steps = run.steps()
    if steps.empty:
        return timeline_figure(pd.DataFrame(), pd.DataFrame(), {}), "", notices(["No steps recorded yet."])
    step = int(steps["step"].max()) if step is None else step
    shown = shown_ranks(run.topology, ranks or [int(steps["rank"].min())], view)
    events = run.events(steps=(step, step), ranks=shown)
    deps = run.dependencies(step, ranks=shown)
    highlight = Highlight(selected=selected)
    if selected is not None:
        highlight.waited_on, highlight.waited_by = related_events(deps, selected)
    if critical:
        path = run.critical_path(step)
        highlight.critical = [int(e) for e in path["event_id"]] if "event_id" in path else []
    figure = timeline_figure(events, deps, {r: rank_label(run.topology, r) for r in shown}, highlight)
    missing = [r for r in shown if events.empty or r not in set(events["rank"])]
    gaps = [f"step {step}: no events from ranks {missing}"] if missing else []
    return figure, selection_details(events, deps, highlight), notices(gaps)


def shown_ranks(topology: pd.DataFrame, ranks: list[int], view: str) -> list[int]:
    """The chosen ranks, widened to their dp/pp/tp groups when asked, at most MAX_ROWS."""
    if view in ("dp", "pp", "tp"):
        ranks = sorted({m for r in ranks for m in group_of_rank(topology, r, view)})
    return sorted(set(ranks))[:MAX_ROWS]


def selection_details(events: pd.DataFrame, deps: pd.DataFrame, highlight: Highlight) -> Component:
    """What the selected event waited on and what waited on it, with the wait of each edge."""
    if highlight.selected is None or events.empty:
        return html.P("Click an event to see what it waited on and what waited on it.", className="muted")
    by_id = events.set_index("event_id")
    if highlight.selected not in by_id.index:
        return html.P("The selected event is not in this view.", className="muted")

    def describe(event_id: int) -> str:
        e = by_id.loc[event_id]
        return f"{e['name']} ({e['kind']} {e['group']}) on rank {e['rank']}, mb {e['microbatch']}"

    def edges(column: str, other: str, ids: set[int]) -> list[html.Li]:
        rows = deps[(deps[column] == highlight.selected) & deps[other].isin(list(ids))]
        return [html.Li(f"{describe(int(r[other]))} [{r['kind']}, wait {1e3 * r['wait_s']:.3f} ms]")
                for _, r in rows.iterrows() if int(r[other]) in by_id.index]

    return html.Div(id=ids.TIMELINE_SELECTION, children=[
        html.H3(f"Selected: {describe(highlight.selected)}"),
        html.H4("waited on"),
        html.Ul(edges("dst_event_id", "src_event_id", highlight.waited_on) or [html.Li("nothing")]),
        html.H4("waited on it"),
        html.Ul(edges("src_event_id", "dst_event_id", highlight.waited_by) or [html.Li("nothing")]),
    ])


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _ranks(text: str | None) -> list[int]:
    return [int(p) for p in (text or "").split(",") if p.strip().lstrip("-").isdigit()]
