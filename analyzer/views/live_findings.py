"""Read back what `megascope watch` announced: RUN/findings.jsonl folded into one row per finding.

The watcher appends a `start` record when a finding appears, an `end` record when it no longer holds,
an `open_at_end` record when it still held when the run finished, and `final` records with the verdict
on the finished run (docs/watch.md, Records). The dashboard shows
the fold: each finding with its onset step and whether it is still open. A finding known by its kind
and ranks that ends and later comes back is two rows (two episodes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from megascope.analyzer.findings import NETWORK_KINDS, Finding, Kind


@dataclass
class LiveFinding:
    finding: Finding
    """As last announced: steps[0] is the onset, steps[1] the last affected step seen."""
    state: str
    """'open' (announced, not ended: also when it held until the run finished, `at_end`) or 'ended'."""
    seen_at: int
    """The last complete step when the watcher announced it (detection latency = seen_at - onset)."""
    ended_at: int | None = None
    final: bool = False
    """The full analysis of the finished run confirmed it."""
    at_end: bool = False
    """It still held when the run finished (`open_at_end`): open until the last step, never ended."""

    @property
    def onset(self) -> int:
        return int(self.finding.steps[0])


def _finding(r: dict) -> Finding:
    # the kind as the watcher wrote it (Finding.to_dict), not checked: one from a newer version still shows
    return Finding(cast(Kind, str(r["kind"])), [int(x) for x in r["ranks"]], [str(h) for h in r.get("hosts") or []],
                   (int(r["steps"][0]), int(r["steps"][1])), float(r["severity"]), str(r["summary"]),
                   r.get("evidence") or {})


def read_live_findings(path: str | Path) -> list[LiveFinding]:
    """The findings the watcher announced in `path` (a findings.jsonl), oldest first; [] when there is
    no such file. Lines that do not parse (one being appended right now) are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    rows: list[LiveFinding] = []
    latest: dict[tuple, LiveFinding] = {}   # kind and ranks -> its latest episode
    for line in lines:
        try:
            r = json.loads(line)
            finding, event, at = _finding(r), r["event"], int(r["at_step"])
        except (ValueError, KeyError, TypeError, IndexError):
            continue
        kind = "network" if finding.kind in NETWORK_KINDS else finding.kind  # one live finding (watch/tracker.py)
        key = (kind, tuple(sorted(finding.ranks)))
        row = latest.get(key)
        if row is None or (event in ("start", "end", "open_at_end") and row.state == "ended"):
            row = latest[key] = LiveFinding(finding, "open", at)
            rows.append(row)
        if event == "update":  # a network finding counted another episode: the record is the whole finding
            row.finding = finding
        elif event == "end":  # its steps run from the onset the watcher kept to the last affected step
            row.state, row.ended_at, row.finding = "ended", at, finding
        elif event == "open_at_end":
            row.at_end, row.finding = True, finding
        elif event == "final":
            row.final = True
    return rows
