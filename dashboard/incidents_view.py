"""The run's incidents (restarts; dead, silent or stalled ranks), recovery times and self-check
results, from the analyzer facade (Run.incidents, Run.recovery_times, Run.self_checks): the overview's
panel, and the ranks they flag for the topology view."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

import pandas as pd
from dash import html

from megascope.analyzer import Run
from megascope.analyzer.views.self_check_records import self_check_ranks
from megascope.dashboard import ids
from megascope.dashboard.widgets import data_table

FAILURE_KINDS = ("dead_rank", "silent_rank", "stall", "node_lost")
"""Incident kinds that name the ranks at fault (the supervisor's detections, a lost node's ranks)."""


def incidents_panel(run: Run) -> html.Div:
    """Incidents in time order, the recovery time of each restart, and each self-check's verdict."""
    incidents, recovery, checks = run.incidents(), run.recovery_times(), run.self_checks()
    if incidents.empty and not checks:
        return html.Div(id=ids.OVERVIEW_INCIDENTS_BODY, children=html.P(
            "No incidents: no restart, no dead, silent or stalled rank, no self-check.", className="muted"))
    parts: list[Any] = []
    if not incidents.empty:
        parts += [html.H4("incidents"), data_table(_incident_rows(incidents), "grid incidents")]
    if not recovery.empty:
        rows = recovery.assign(ranks=recovery["ranks"].map(_ranks_text))
        parts += [html.H4("recovery (failure to resumed training)"),
                  data_table(rows.rename(columns={"recovery_s": "recovery(s)"}), "grid recovery")]
    if checks:
        parts += [html.H4("self-checks before restarts"), data_table(self_check_rows(checks), "grid self-checks")]
    return html.Div(id=ids.OVERVIEW_INCIDENTS_BODY, children=parts)


def self_check_rows(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per self-check record: attempt, flagged ranks and hosts (with how far below their
    peers), the decision and whether it was enforced."""
    rows = []
    for rec in records:
        decision = rec.get("decision") or {}
        rows.append({"attempt": rec.get("attempt"), "flagged ranks": _ranks_text(rec.get("flagged_ranks")) or "none",
                     "flagged hosts": ", ".join(map(str, rec.get("flagged_hosts") or [])) or "none",
                     "measured": _flagged_measures(rec), "decision": decision.get("action", "?"),
                     "reason": decision.get("reason", ""),
                     "enforced": "yes" if rec.get("enforced") else "recorded only"})
    return pd.DataFrame(rows)


def flagged_ranks(run: Run) -> dict[int, list[str]]:
    """Rank -> why it is flagged: the supervisor's detections and self-check verdicts."""
    flagged: dict[int, list[str]] = {}
    incidents = run.incidents()
    for row in incidents[incidents["kind"].isin(FAILURE_KINDS)].itertuples():
        for rank in _as_ranks(row.ranks):
            flagged.setdefault(rank, []).append(f"{row.kind} (attempt {_int_text(row.attempt)}): {row.detail}")
    for rec in run.self_checks():
        for rank in _as_ranks(rec.get("flagged_ranks")):
            flagged.setdefault(rank, []).append(
                f"self-check before attempt {rec.get('attempt')}: far below its peers; decision "
                f"{(rec.get('decision') or {}).get('action', '?')}")
    return flagged


def _incident_rows(incidents: pd.DataFrame) -> pd.DataFrame:
    frame = incidents[["time", "kind", "attempt", "ranks", "hosts", "step", "detail", "action"]].copy()
    frame["time"] = frame["time"].map(_time_text)
    for col in ("attempt", "step"):
        frame[col] = frame[col].map(_int_text)
    frame["ranks"] = frame["ranks"].map(_ranks_text)
    frame["hosts"] = frame["hosts"].map(lambda h: ", ".join(map(str, h)) if isinstance(h, list) else _str_or_blank(h))
    for col in ("detail", "action"):
        frame[col] = frame[col].map(_str_or_blank)
    return frame


def _flagged_measures(record: dict[str, Any]) -> str:
    """For each flagged rank, its numbers against the median of all ranks ('rank 1: gemm_tflops 20 vs 100')."""
    ranks = self_check_ranks(record)
    if ranks.empty or not ranks["flagged"].any():
        return ""
    numeric = [c for c in ranks.columns
               if c not in ("rank", "host", "flagged") and pd.api.types.is_numeric_dtype(ranks[c])]
    medians = ranks[numeric].median()
    out = []
    for row in ranks[ranks["flagged"]].itertuples(index=False):
        values = [f"{c} {getattr(row, c):.3g} vs {medians[c]:.3g}" for c in numeric
                  if isinstance(getattr(row, c), (int, float)) and not math.isnan(getattr(row, c))]
        out.append(f"rank {row.rank}: " + ", ".join(values))
    return "; ".join(out)


def _as_ranks(value: Any) -> list[int]:
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
        return [int(value)]
    return []


def _ranks_text(value: Any) -> str:
    ranks = _as_ranks(value)
    return ", ".join(map(str, ranks[:16])) + (f" (+{len(ranks) - 16})" if len(ranks) > 16 else "") if ranks else ""


def _int_text(value: Any) -> str:
    try:
        return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(int(value))
    except (TypeError, ValueError):
        return str(value)


def _str_or_blank(value: Any) -> str:
    """Fields a record did not have come back as None or NaN: shown blank."""
    return value if isinstance(value, str) else ""


def _time_text(value: Any) -> str:
    """Incident times are Unix seconds: shown in UTC to the second."""
    try:
        return datetime.fromtimestamp(float(value), tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        return str(value)
