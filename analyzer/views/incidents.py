"""Incidents of a run (RUN/incidents.jsonl): what the driver's supervisor detected (dead, silent or
stalled ranks, failed self-checks), the elastic restarts, and when training resumed.

    from megascope.analyzer.views.incidents import read_incidents, recovery_times
    read_incidents("runs/x")      # DataFrame: time, kind, attempt, ranks, hosts, detail, action
    Run.open("runs/x").incidents()  # the same through the facade
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from megascope.tracer.run_dir import INCIDENTS_FILE

COLUMNS = ["time", "kind", "attempt", "ranks", "hosts", "step", "detail", "action"]


def read_incidents(run_dir: str | Path, warnings: list[str] | None = None) -> pd.DataFrame:
    """One row per incident, in time order; empty (with the columns) when the run had none."""
    path = Path(run_dir) / INCIDENTS_FILE
    rows = []
    if path.is_file():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as exc:  # a line cut by a crash of the writer
                if warnings is not None:
                    warnings.append(f"incidents.jsonl line {n} unreadable: {exc}")
    df = pd.DataFrame(rows, columns=None if rows else COLUMNS)
    for col in COLUMNS:
        if col not in df.columns:
            df[col] = None
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]].sort_values("time", ignore_index=True)


def recovery_times(incidents: pd.DataFrame) -> pd.DataFrame:
    """Per restart: the failure (first detection of the attempt), when the next attempt completed its
    first step, and the seconds in between (failure to resumed training)."""
    failures = incidents[incidents.kind.isin(["dead_rank", "silent_rank", "stall"])]
    resumed = incidents[incidents.kind == "resumed"]
    rows = []
    for _, res in resumed.iterrows():
        before = failures[(failures.attempt == res.attempt - 1) & (failures.time <= res.time)]
        if before.empty:
            continue
        fail = before.iloc[0]
        rows.append({"attempt": int(res.attempt), "failure": fail.kind, "ranks": fail.ranks,
                     "resumed_step": res.step, "recovery_s": float(res.time - fail.time)})
    return pd.DataFrame(rows, columns=["attempt", "failure", "ranks", "resumed_step", "recovery_s"])


def summarize(df: pd.DataFrame) -> list[str]:
    """Lines for the text report: each incident (from read_incidents) in words, then the recovery times."""
    lines = [f"{row.kind}: {row.detail}" + (f" -> {row.action}" if isinstance(row.action, str) else "")
             for row in df.itertuples()]
    for row in recovery_times(df).itertuples():
        lines.append(f"attempt {row.attempt}: training resumed {row.recovery_s:.1f} s after the {row.failure}")
    return lines
