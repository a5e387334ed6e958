"""Self-check results of a run (RUN/self_check/attempt-NN.json, written by trainer/robust/self_check.py before
each restart): per-rank GEMM speed, link and all-reduce bandwidth, the flagged ranks and hosts, and
the node decision (continue, exclude, stop).

    from megascope.analyzer.views.self_check_records import read_self_checks, self_check_ranks
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from megascope.tracer.run_dir import SELF_CHECK_DIR


def read_self_checks(run_dir: str | Path, warnings: list[str] | None = None) -> list[dict[str, Any]]:
    """Every attempt's record, oldest first."""
    folder = Path(run_dir) / SELF_CHECK_DIR
    out = []
    for f in sorted(folder.glob("attempt-*.json")) if folder.is_dir() else []:
        try:
            out.append(json.loads(f.read_text()))
        except ValueError as exc:
            if warnings is not None:
                warnings.append(f"skipped unreadable self-check record {f.name}: {exc}")
    return out


def self_check_ranks(record: dict[str, Any]) -> pd.DataFrame:
    """One row per rank of one record: host, gemm_tflops, p2p_in_gbps, allreduce_busbw_gbps, flagged."""
    hosts = record.get("hosts", [])
    flagged = set(record.get("flagged_ranks", []))
    rows = [{"rank": int(r), "host": hosts[int(r)] if int(r) < len(hosts) else None, **values,
             "flagged": int(r) in flagged} for r, values in record.get("ranks", {}).items()]
    return pd.DataFrame(rows).sort_values("rank", ignore_index=True) if rows else pd.DataFrame(
        columns=["rank", "host", "gemm_tflops", "flagged"])


def summarize(records: list[dict[str, Any]]) -> list[str]:
    """Lines for the text report, one per self-check record (from read_self_checks)."""
    lines = []
    for rec in records:
        d = rec.get("decision", {})
        flagged = rec.get("flagged_ranks", [])
        lines.append(f"self-check before attempt {rec.get('attempt')}: "
                     + (f"ranks {flagged} (hosts {rec.get('flagged_hosts')}) far below their peers; "
                        if flagged else "all ranks and links within range; ")
                     + f"decision {d.get('action')}: {d.get('reason')}"
                     + ("" if rec.get("enforced") else " (recorded only)"))
    return lines
