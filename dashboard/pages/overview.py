"""Overview: the run's topology and config, MFU and step time over steps, the live findings of
`megascope watch` (RUN/findings.jsonl), the findings, and the incidents, recovery times and self-check
results of a run that restarted. Findings are listed the costliest first with their cost and cause."""

from __future__ import annotations

from urllib.parse import urlencode

import dash
from dash import Input, Output, callback, dcc, html
from dash.development.base_component import Component

from megascope.analyzer import Finding, Run
from megascope.analyzer.detect.cause import cause_text
from megascope.analyzer.findings import cost_text
from megascope.analyzer.views.heatmap import CAUSE_METRICS
from megascope.analyzer.views.links import finding_links
from megascope.analyzer.views.live_findings import LiveFinding
from megascope.dashboard import ids
from megascope.dashboard.incidents_view import incidents_panel
from megascope.dashboard.run_gaps import describe_gaps
from megascope.dashboard.runs import current_catalog
from megascope.dashboard.series_figure import mfu_figure
from megascope.dashboard.widgets import key_values, notices

dash.register_page(__name__, path="/", name="Overview", order=0, title="megascope: overview")

# finding kind -> (page, heatmap metric) that shows it best
_FINDING_VIEWS = {
    "straggler": ("heatmap", "compute"), "stage_imbalance": ("heatmap", "compute"),
    "workload_imbalance": ("heatmap", "compute"), "late_launch": ("heatmap", "lateness"),
    "network_flap": ("heatmap", "exposed_comm"), "slow_link": ("heatmap", "exposed_comm"),
    "hang": ("topology", None),
}


def layout(**_query: str) -> html.Div:
    return html.Div([
        html.H2("Overview"),
        html.Div(id=ids.OVERVIEW_NOTICES),
        html.Div(className="row", children=[
            html.Div(id=ids.OVERVIEW_SUMMARY, className="panel panel-narrow"),
            html.Div(className="panel panel-wide", children=[
                html.H3("MFU and step time"),
                dcc.Graph(id=ids.OVERVIEW_MFU, config={"displaylogo": False}),
            ]),
        ]),
        html.Div(className="panel", children=[html.H3("Live findings (megascope watch)"),
                                              html.Div(id=ids.OVERVIEW_LIVE)]),
        html.Div(className="panel", children=[html.H3("Findings"), html.Div(id=ids.OVERVIEW_FINDINGS)]),
        html.Div(className="panel", children=[html.H3("Incidents, restarts and self-checks"),
                                              html.Div(id=ids.OVERVIEW_INCIDENTS)]),
    ])


@callback(Output(ids.OVERVIEW_NOTICES, "children"), Output(ids.OVERVIEW_SUMMARY, "children"),
          Output(ids.OVERVIEW_MFU, "figure"), Output(ids.OVERVIEW_FINDINGS, "children"),
          Output(ids.OVERVIEW_INCIDENTS, "children"),
          Input(ids.APP_RUN, "value"), Input(ids.APP_INTERVAL, "n_intervals"))
def refresh(run_value: int | None, _tick: int | None):
    catalog = current_catalog()
    index = catalog.index(run_value)
    return catalog.cached(index, ("overview",), lambda run: (
        notices(describe_gaps(run)), run_summary(run), mfu_figure(run.mfu().per_step),
        findings_table(run.costed_findings(), index), incidents_panel(run)))


@callback(Output(ids.OVERVIEW_LIVE, "children"), Input(ids.APP_RUN, "value"), Input(ids.APP_INTERVAL, "n_intervals"))
def refresh_live(run_value: int | None, _tick: int | None):
    """Read anew on every refresh, not memoized with the rest: the watcher appends to findings.jsonl
    after the run's last segment (its final verdict), which the catalog's directory signature does not
    see; the file is small (a few records per finding)."""
    catalog = current_catalog()
    index = catalog.index(run_value)
    with catalog.using(index) as run:
        return live_table(run.live_findings(), index)


def run_summary(run: Run) -> html.Div:
    """Run id, topology and model shape from run.json, and the mean MFU."""
    m = run.manifest
    topo, model = m.get("topology", {}), m.get("model", {})
    mean = run.mfu().mean
    rows = [("run", m.get("run_id", "?")), ("started", m.get("start_time", "?")),
            ("world", topo.get("world", len(run.topology))),
            ("dp x pp x tp", f"{topo.get('dp', '?')} x {topo.get('pp', '?')} x {topo.get('tp', '?')}"),
            ("hosts", run.topology["host"].nunique() if not run.topology.empty else 0),
            ("model", ", ".join(f"{k} {v}" for k, v in model.items() if not isinstance(v, (dict, list)))),
            ("peak FLOP/s per device", _peak_text(m.get("peak_flops"))),
            ("mean MFU(%)", "n/a" if mean is None or mean != mean else f"{100 * mean:.2f}")]
    return html.Div([html.H3("Run"), key_values(rows)])


def findings_table(costed: list[tuple[Finding, dict | None]], run_index: int) -> Component:
    """One row per finding, the costliest first (Run.costed_findings: the report's order and prices):
    its cost (seconds, share of the run's lost time, GPU-hours), its cause in words (explained_by, with
    the heatmap of the cause's own measure behind "show"), and a link to the page that shows it."""
    if not costed:
        return html.P("No findings: no straggler, imbalance, late launch, flap or hang detected.",
                      className="muted")
    head = html.Tr([html.Th(h) for h in ("kind", "ranks", "hosts", "steps", "cost", "cause", "summary", "")])
    rows = [html.Tr([html.Td(f.kind), html.Td(_short(f.ranks)), html.Td(_short(f.hosts)),
                     html.Td(f"{f.steps[0]}-{f.steps[1]}" if f.steps else ""),
                     html.Td(_cost(f, wi), className="finding-cost"), html.Td(_cause(f), className="finding-cause"),
                     html.Td(f.summary), html.Td(dcc.Link("show", href=finding_href(f, run_index)))],
                    className=f"finding finding-{f.kind}")
            for f, wi in costed]
    return html.Table([html.Thead(head), html.Tbody(rows)], className="grid findings", id=ids.OVERVIEW_FINDINGS_TABLE)


def _cost(f: Finding, what_if: dict | None) -> str:
    """'0.384 s (16% of the run's lost time; 0.001 GPU-hours)', '... by its what-if', or its what-if's
    throughput share alone; '' when nothing prices it."""
    if f.evidence.get("cost_s") is not None:
        return cost_text(f.evidence)
    if what_if and what_if.get("applicable") and what_if.get("throughput_lost") is not None:
        return f"what-if: {100 * what_if['throughput_lost']:.1f}% throughput"
    return ""


def _cause(f: Finding) -> str:
    """'data_loading: rank 1 waits 24 ms a step for its data loader' (the finding's explained_by)."""
    cause = f.evidence.get("explained_by")
    if not cause:
        return ""
    return f"{cause}: {cause_text(cause, float(f.evidence.get('explained_ms') or 0.0), list(f.ranks))}"


def live_table(rows: list[LiveFinding], run_index: int) -> Component:
    """What the watcher announced, newest first: state, onset, when it was seen and ended, and links
    to the heatmap (on the finding's metric) and the timeline at its onset."""
    if not rows:
        return html.P("No live findings: no watcher records in this run (start `megascope watch RUN` beside "
                      "the job, or `megascope train --watch`), or it has announced nothing.", className="muted")
    head = html.Tr([html.Th(h) for h in ("state", "kind", "ranks", "onset step", "seen at step", "ended at step",
                                         "summary", "")])
    body = [html.Tr([html.Td(r.state + (", confirmed" if r.final else ""), className=f"live-{r.state}"),
                     html.Td(r.finding.kind), html.Td(_short(r.finding.ranks)), html.Td(str(r.onset)),
                     html.Td(str(r.seen_at)), html.Td("" if r.ended_at is None else str(r.ended_at)),
                     html.Td(r.finding.summary),
                     html.Td([dcc.Link(_page_of(r.finding), href=finding_href(r.finding, run_index)), " ",
                              dcc.Link("timeline", href=timeline_href(r.finding, run_index))])],
                    className=f"finding finding-{r.finding.kind} live-{r.state}")
            for r in sorted(rows, key=lambda r: (r.state != "open", -r.seen_at))]
    return html.Table([html.Thead(head), html.Tbody(body)], className="grid findings", id=ids.OVERVIEW_LIVE_TABLE)


def _view_of(finding: Finding) -> tuple[str, str | None]:
    """(page, heatmap metric) of a finding: a network finding on p2p links is drawn on the link view, a
    finding with a measured cause on the heatmap of that cause's measure (GC pauses for
    garbage_collection, ...), the rest on their kind's metric."""
    if finding_links(finding):
        return "links", None
    cause = CAUSE_METRICS.get(str(finding.evidence.get("explained_by")))
    if cause is not None:
        return "heatmap", cause
    return _FINDING_VIEWS.get(finding.kind, ("timeline", None))


def _page_of(finding: Finding) -> str:
    return _view_of(finding)[0]


def timeline_href(finding: Finding, run_index: int) -> str:
    """The timeline at a finding's onset step, on its ranks."""
    query: dict[str, object] = {"run": run_index, "step": finding.steps[0]}
    if finding.ranks:
        query["ranks"] = ",".join(str(r) for r in list(finding.ranks)[:8])
    return f"/timeline?{urlencode(query)}"


def finding_href(finding: Finding, run_index: int) -> str:
    """The page that shows a finding: the link view for a network finding on p2p links, the heatmap on
    its metric, or the topology for a hang."""
    page, metric = _view_of(finding)
    query: dict[str, object] = {"run": run_index}
    if metric:
        query["metric"] = metric
    if finding.ranks:
        query["ranks"] = ",".join(str(r) for r in list(finding.ranks)[:8])
    if finding.steps:
        query["step"] = finding.steps[0]
    return f"/{page}?{urlencode(query)}"


def _peak_text(peak: object) -> str:
    """run.json's peak_flops block: {"per_device": 9.9e14, "source": ..., "device": ...}."""
    if isinstance(peak, dict) and peak.get("per_device"):
        return f"{float(peak['per_device']):.3g} ({peak.get('device', '?')}, from {peak.get('source', '?')})"
    return "?" if peak is None else str(peak)


def _short(values, limit: int = 8) -> str:
    values = list(values or [])
    text = ", ".join(str(v) for v in values[:limit])
    return text + (f" (+{len(values) - limit})" if len(values) > limit else "")
