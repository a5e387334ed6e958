"""The report object of `megascope analyze --json` (docs/report.schema.json) and its text rendering."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megascope.analyzer.findings import cost_text
from megascope.analyzer.settings import settings_dict

if TYPE_CHECKING:
    from megascope.analyzer.run import Run

SCHEMA_VERSION = 1
"""Version of the `--json` report (docs/report.schema.json). Bump it on any change a reader could
trip on: a field removed, renamed or given another type (adding an optional field is compatible)."""


def _num(x: float, digits: int = 6) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), digits)


def build_report(run: "Run", with_what_if: bool = True) -> dict:
    man = run.manifest
    topo = man.get("topology", {})
    mfu = run.mfu()
    out_findings = []
    for f, wi in run.costed_findings(with_what_if):
        d = f.to_dict()
        if wi is not None:
            d["what_if"] = wi
        out_findings.append(d)
    per_step = [{"step": int(r.step), "step_time_s": _num(r.step_time_s), "tokens_per_s": _num(r.tokens_per_s, 1),
                 "mfu": _num(r.mfu, 5)} for r in mfu.per_step.itertuples()]
    return {
        "schema_version": SCHEMA_VERSION,
        "run": {"path": str(run.path), "run_id": man.get("run_id"), "source": man.get("source"),
                "world": topo.get("world"), "dp": topo.get("dp"), "tp": topo.get("tp"), "pp": topo.get("pp"),
                "vpp": topo.get("vpp", 1), "steps": len(per_step), "judged_rank_steps": _judged(run),
                "peak_flops_per_device": _num(mfu.peak_flops, 1)},
        "mfu": {"mean": _num(mfu.mean, 5),
                "mean_step_time_s": _num(float(mfu.per_step.step_time_s.mean()) if per_step else float("nan")),
                "mean_tokens_per_s": _num(float(mfu.per_step.tokens_per_s.mean()) if per_step else float("nan"), 1),
                "per_step": per_step},
        "findings": out_findings,
        "incomplete_data": run.incomplete_data(),
        "robustness": _robustness(run),
        "warnings": list(run.warnings),
        "settings": settings_dict(run.settings),
    }


def _judged(run: "Run") -> int:
    """Rank-steps with traced events: what the detectors had to judge (0: no verdict is possible).
    Counted in SQL: rank_steps() as a frame was 12.3 M rows at 12,288 ranks x 1,000 steps."""
    run.derived.rank_step()
    columns = set(run.store.query("SELECT column_name FROM (DESCRIBE rank_step)").column_name)
    if "n_events" not in columns:
        return 0
    return int(run.store.query("SELECT count(*) FILTER (WHERE n_events > 0) AS n FROM rank_step").n.iloc[0])


def _robustness(run: "Run") -> dict:
    """Incidents, restarts and self-checks of a run trained with [robust] (empty lists otherwise)."""
    from megascope.analyzer.views import incidents, self_check_records
    df = run.incidents()
    records = run.self_checks()
    return {"incidents": json_safe(df.to_dict("records")),
            "recovery": json_safe(run.recovery_times().to_dict("records")),
            "self_checks": json_safe(records),
            "summary": incidents.summarize(df) + self_check_records.summarize(records)}


def _steps_text(first: int, last: int) -> str:
    if last < 0:
        return "no step"
    return f"step {first}" if first == last else f"steps {first}-{last}"


def finding_cost_text(f: dict) -> str:
    """' [cost 0.047 s (16% of the run's lost time; 0.16 GPU-hours)] [what-if: 2.3% throughput]' for
    the text report: the finding's cost as its evidence states it, then its what-if, each when it has
    one. Severity is left out: it means another thing for every kind (findings.Finding.severity)."""
    ev, wi, out = f.get("evidence") or {}, f.get("what_if") or {}, ""
    if ev.get("cost_s") is not None:
        out += f" [cost {cost_text(ev)}]"
    if wi.get("applicable") and wi.get("throughput_lost") is not None:
        out += f" [what-if: {100 * wi['throughput_lost']:.1f}% throughput]"
    return out


def render_text(report: dict) -> str:
    """Findings first (one actionable sentence each), then the MFU summary."""
    lines = []
    r = report["run"]
    sizes = [r.get(k) or 1 for k in ("dp", "tp", "pp")]
    # context parallelism (imports with cp): the world holds cp x dp x tp x pp ranks
    cp = (r.get("world") or 0) // (sizes[0] * sizes[1] * sizes[2])
    cp_text = f" cp={cp}" if cp > 1 else ""
    lines.append(f"megascope analysis of {r['path']} ({r['source']}, {r['world']} ranks: dp={r['dp']}{cp_text} "
                 f"tp={r['tp']} pp={r['pp']} vpp={r['vpp']}, {r['steps']} steps)")
    lines.append("")
    if report["findings"]:
        lines.append(f"Findings ({len(report['findings'])}):")
        for i, f in enumerate(report["findings"], 1):
            lines.append(f"  {i}. [{f['kind']}, {_steps_text(*f['steps'])}]{finding_cost_text(f)} {f['summary']}")
    elif r.get("judged_rank_steps", 1) == 0:  # no events, no verdict: silence is not health
        lines.append("Findings: no verdict: the run holds no traced events to judge (a job run with --trace off, "
                     "or attached without model= and optimizer=, records steps at most); trace it and analyze again.")
    else:
        lines.append("Findings: none (no stragglers, late launches, imbalance, link problems or hangs detected).")
    lines += _incomplete_text(report.get("incomplete_data") or [])
    robust = report.get("robustness", {}).get("summary") or []
    if robust:
        lines.append("")
        lines.append("Incidents, restarts and self-checks:")
        lines += [f"  - {line}" for line in robust]
    lines.append("")
    m = report["mfu"]
    if m["per_step"]:
        mfu = "n/a (unknown peak FLOP/s)" if m["mean"] is None else f"{100 * m['mean']:.1f}%"
        lines.append(f"MFU: mean {mfu}; step time {m['mean_step_time_s']:.3f} s; "
                     f"{m['mean_tokens_per_s']:.0f} tokens/s over {len(m['per_step'])} steps")
        worst = slowest_step(m["per_step"])
        warmup = f" (warm-up step {m['per_step'][0]['step']} aside)" if len(m["per_step"]) > 1 else ""
        lines.append(f"     slowest step{warmup} {worst['step']}: {worst['step_time_s']:.3f} s")
    else:
        lines.append("MFU: no steps recorded.")
    for w in report["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def slowest_step(per_step: list[dict]) -> dict:
    """The slowest step after the first (warm-up: compilation, allocator and cache warm-up make it
    several times the others, 1.9 s against 0.3-0.4 s in the demo); the first when it is the only one."""
    later = per_step[1:] or per_step
    return max(later, key=lambda s: s["step_time_s"] or 0)


def _incomplete_text(items: list[dict]) -> list[str]:
    if not items:
        return []
    out = ["", "Incomplete data (left out of the diagnosis: neither slow nor fast):"]
    for item in items:
        out.append(f"  - rank {item['rank']}, {_steps_text(*item['steps'])}: {item['segment']} {incomplete_why(item)}")
    return out


def incomplete_why(item: dict) -> str:
    """How an incomplete-data entry came to be, for the text and HTML reports."""
    if item.get("reason", "damaged") == "damaged":
        return "is damaged"
    return "holds rows that contradict the run (left out)"


def json_safe(obj):
    """NaN/inf -> None and numpy scalars -> Python, so the report is strict JSON."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
