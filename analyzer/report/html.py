"""`--html FILE`: a self-contained report (plotly inlined). The only module of the analyzer that draws."""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

from megascope.analyzer.findings import cost_text
from megascope.analyzer.report.build import incomplete_why
from megascope.analyzer.report.plots import PlotData
from megascope.analyzer.views.heatmap import METRICS, color_range

_STYLE = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
          "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top}")
_FINDINGS_HEADER = ("<tr><th>kind</th><th>steps</th><th>cost</th><th>throughput lost (what-if)</th>"
                    "<th>ranks</th><th>summary</th></tr>")
"""The findings table, costliest first as the report orders them; severity is left out as in the text
report (it means another thing for every kind)."""


def _figures(data: PlotData) -> list[go.Figure]:
    mfu = data.mfu
    figs = []
    fig = go.Figure(go.Scatter(x=mfu.step, y=100 * mfu.mfu, mode="lines+markers", name="MFU"))
    fig.update_layout(title="MFU per step (%)", xaxis_title="step", yaxis_title="mfu(%)", height=320)
    figs.append(fig)
    fig = go.Figure(go.Scatter(x=mfu.step, y=mfu.step_time_s, mode="lines+markers", name="step time"))
    fig.update_layout(title="Step time (s)", xaxis_title="step", yaxis_title="step_time(s)", height=320)
    figs.append(fig)
    parts = data.breakdown
    fig = go.Figure([go.Bar(x=parts.index, y=parts[c], name=c) for c in parts.columns])
    fig.update_layout(barmode="stack", title="Step-time breakdown, mean over ranks (s)", height=360)
    figs.append(fig)
    for metric, hm in data.heatmaps.items():
        # as the dashboard: the warm-up step (several times a normal step) must not wash out a straggler
        zmin, zmax, clipped = color_range(hm.values, METRICS[metric].higher_is_worse)
        fig = go.Figure(go.Heatmap(z=hm.values, x=hm.cols, y=hm.rows, colorscale="Viridis", zmin=zmin, zmax=zmax,
                                   colorbar={"title": hm.unit + ("<br>(outliers clipped)" if clipped else "")}))
        fig.update_layout(title=f"{metric} per rank and step ({hm.unit})", xaxis_title="step",
                          yaxis_title=hm.group_by, height=480)
        figs.append(fig)
    return figs


def _cost(finding: dict) -> str:
    """The cost cell: seconds, share of the lost time and GPU-hours, as in the text report."""
    ev = finding.get("evidence") or {}
    if ev.get("cost_s") is None:
        return "n/a"
    return cost_text(ev)


def _what_if(finding: dict) -> str:
    """The what-if cell: throughput lost to the finding, as in the text report."""
    wi = finding.get("what_if") or {}
    if wi.get("applicable") and wi.get("throughput_lost") is not None:
        return f"{100 * wi['throughput_lost']:.1f}%"
    return "n/a"


def write_html(report: dict, plots: PlotData, path: str | Path) -> Path:
    """The report with its plots (report/plots.py: plot_data(run)) as one self-contained page."""
    rows = "".join(
        f"<tr><td>{html.escape(f['kind'])}</td><td>{f['steps'][0]}-{f['steps'][1]}</td>"
        f"<td>{html.escape(_cost(f))}</td><td>{_what_if(f)}</td>"
        f"<td>{html.escape(', '.join(map(str, f['ranks'][:16])))}</td>"
        f"<td>{html.escape(f['summary'])}</td></tr>" for f in report["findings"]) or \
        "<tr><td colspan=6>No findings.</td></tr>"
    incomplete = "".join(f"<li>rank {d['rank']}, steps {d['steps'][0]}-{d['steps'][1]}: "
                         f"{html.escape(d['segment'])} {html.escape(incomplete_why(d))}</li>"
                         for d in report.get("incomplete_data", []))
    incomplete = ("<h2>Incomplete data</h2><p>Left out of the diagnosis (neither slow nor fast):</p>"
                  f"<ul>{incomplete}</ul>" if incomplete else "")
    robust = "".join(f"<li>{html.escape(line)}</li>" for line in report.get("robustness", {}).get("summary", []))
    robust = f"<h2>Incidents and restarts</h2><ul>{robust}</ul>" if robust else ""
    figs = _figures(plots)
    figures = "".join(pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs))
    r = report["run"]
    mean = report["mfu"]["mean"]
    title = html.escape(str(r["run_id"]))
    shape = f"dp={r['dp']} tp={r['tp']} pp={r['pp']} vpp={r['vpp']}"
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>megascope report {title}</title>
<style>{_STYLE}</style>
</head><body><h1>megascope report</h1>
<p>{html.escape(str(r['path']))}: {r['world']} ranks ({shape}), {r['steps']} steps,
mean MFU {'n/a' if mean is None else f'{100 * mean:.1f}%'}.</p>
<h2>Findings</h2><table>{_FINDINGS_HEADER}{rows}</table>
{incomplete}
{robust}
<h2>Plots</h2>{figures}
{''.join(f'<p>warning: {html.escape(w)}</p>' for w in report['warnings'])}
</body></html>"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)
    return path
