"""Links: p2p link (rank pair, grouped by host pair) x step, with the network findings outlined; a click
opens the step in the timeline on the link's two ends."""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, dcc, html
from dash.development.base_component import Component

from megascope.analyzer.findings import NETWORK_KINDS, Finding
from megascope.analyzer.views.links import LinkMap, finding_episodes, finding_links
from megascope.dashboard import ids
from megascope.dashboard.link_figure import METRICS, clicked_link, link_figure, timeline_href
from megascope.dashboard.runs import current_catalog

dash.register_page(__name__, path="/links", name="Links", order=2, title="megascope: links")

MAX_ROWS = 256  # links on screen at most; the analyzer folds neighbouring links of a host pair beyond it
MAX_COLS = 500


def layout(metric: str = "wait", **_query: str) -> html.Div:
    return html.Div([
        html.H2("Links: p2p link x step"),
        html.Div(className="controls", children=[
            html.Label(["metric", dcc.RadioItems(id=ids.LINKS_METRIC, value=metric if metric in METRICS else "wait",
                                                 inline=True,
                                                 options=[{"label": v, "value": k} for k, v in METRICS.items()])]),
        ]),
        html.P("Rows are pipeline links (their two ranks), grouped by host pair, links between hosts first; "
               "network findings are outlined over their links and episodes. Click a cell to open that step "
               "in the timeline on the link's two ends.", className="muted"),
        dcc.Loading(dcc.Graph(id=ids.LINKS_GRAPH, config={"displaylogo": False})),
        html.Div(className="panel", children=[html.H3("Network findings"), html.Div(id=ids.LINKS_FINDINGS)]),
    ])


@callback(Output(ids.LINKS_GRAPH, "figure"), Output(ids.LINKS_FINDINGS, "children"),
          Input(ids.LINKS_METRIC, "value"), Input(ids.APP_RUN, "value"), Input(ids.APP_INTERVAL, "n_intervals"))
def update_links(metric: str, run_value: int | None, _tick: int | None):
    metric = metric if metric in METRICS else "wait"
    catalog = current_catalog()
    index = catalog.index(run_value)
    view: LinkMap = catalog.cached(index, ("links",), lambda run: run.links(MAX_ROWS, MAX_COLS))
    findings: list[Finding] = catalog.cached(index, ("findings",), lambda run: run.findings())
    return link_figure(view, metric), findings_table(findings, view, index)


@callback(Output(ids.APP_URL, "href", allow_duplicate=True), Input(ids.LINKS_GRAPH, "clickData"),
          State(ids.APP_RUN, "value"), prevent_initial_call=True)
def open_in_timeline(click_data: dict | None, run_value: int | None):
    """A clicked cell -> the timeline at that step, on the link's two ends."""
    cell = clicked_link(click_data)
    if cell is None:
        return dash.no_update
    step, link = cell
    return timeline_href(current_catalog().index(run_value), step, link)


def findings_table(findings: list[Finding], view: LinkMap, run_index: int) -> Component:
    """The run's network findings: their links, episodes, and whether the view outlines them (a
    collective group's finding is not on a p2p link: the heatmap's exposed communication shows it)."""
    network = [f for f in findings if f.kind in NETWORK_KINDS]
    if not network:
        return html.P("No network findings: no link flapped or ran slow against its peers, and no step's lost "
                      "time was the network's.", className="muted")
    drawn = {_key(m.finding) for m in view.marks}
    head = html.Tr([html.Th(h) for h in ("kind", "hosts", "links", "episodes (steps)", "summary", "")])
    rows = []
    for f in network:
        links = finding_links(f)
        onset = f.steps[0]
        target = (dcc.Link("timeline", href=timeline_href(run_index, onset, links[0])) if links else
                  dcc.Link("heatmap", href=f"/heatmap?run={run_index}&metric=exposed_comm"))
        rows.append(html.Tr([
            html.Td(f.kind), html.Td(", ".join(f.hosts)),
            html.Td(", ".join(f"{a}-{b}" for a, b in links) if links else "a collective group (not a p2p link)"),
            html.Td(", ".join(f"{a}-{b}" if a != b else str(a) for a, b in finding_episodes(f))),
            html.Td(f.summary + ("" if _key(f) in drawn or not links else " (its links carried no p2p rows here)")),
            html.Td(target)], className=f"finding finding-{f.kind}"))
    return html.Table([html.Thead(head), html.Tbody(rows)], className="grid findings", id=ids.LINKS_FINDINGS_TABLE)


def _key(finding: Finding) -> tuple:
    """A finding's identity across two reads of the run's findings (the view's and this page's)."""
    return finding.kind, tuple(finding.ranks), tuple(finding.steps)
