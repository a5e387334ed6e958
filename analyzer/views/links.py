"""The link view: p2p links (rank pairs, grouped by host pair) x step, with the network findings on them.

A slow link between hosts shows in no rank x step metric by itself: the ranks at both ends wait, and
the heatmap's exposed-communication time mixes that with collectives. Here each row is one pipeline
link (or a few neighbouring ones, folded in DuckDB when there are more than max_rows), each column a
step (or a few), and three metrics of link_step.sql: the time both ends waited on the link, its fastest
transfer, and the rate of that transfer. The network findings (network_flap, slow_link: the flap
detector's per link, the lost-time attribution's per host pair naming its links) are placed on the rows
of their links over their episodes."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from megascope.analyzer.data.event_pass import has_wait_spans
from megascope.analyzer.data.store import Store, load_sql
from megascope.analyzer.findings import NETWORK_KINDS, Finding
from megascope.tracer.schema import WAIT_SUFFIX


class LinkMetric(NamedTuple):
    unit: str
    higher_is_worse: bool
    label: str


METRICS: dict[str, LinkMetric] = {
    "wait": LinkMetric("s", True, "p2p wait, both ends (s)"),
    "transfer": LinkMetric("s", True, "fastest transfer (s)"),
    "rate": LinkMetric("B/s", False, "transfer rate (bytes/s)"),
}
"""The link view's metrics (link_step.sql's wait_s, transfer_s, bytes_per_s), the one list."""
_COLUMNS = {"wait": "wait_s", "transfer": "transfer_s", "rate": "bytes_per_s"}


@dataclass
class LinkMark:
    """A network finding placed on the view: the rows of its links, the columns of its episodes."""
    finding: Finding
    rows: list[int]
    """Row indices (sorted) holding at least one of its links."""
    spans: list[tuple[int, int]]
    """Column index ranges [first, last], one per episode."""


@dataclass
class LinkMap:
    rows: list[str]
    """Row labels: 'hostA-hostB · 1-5', or 'hostA-hostB · 1-5 .. 3-7 (4 links)' for a folded row (its
    first and last host pair when it spans two)."""
    row_links: list[tuple[int, int]]
    """The first link (a, b) of each row: the ranks a click opens in the timeline."""
    host_pairs: list[str]
    """Host pair of each row's first link."""
    cols: list[int]
    """First step of each column."""
    values: dict[str, np.ndarray] = field(default_factory=dict)
    """Metric -> rows x cols, NaN where the link had no traffic in the step."""
    marks: list[LinkMark] = field(default_factory=list)

    def col_of(self, step: int) -> int:
        """The column holding a step (steps before the first fall in the first)."""
        return max(bisect_right(self.cols, step) - 1, 0)


def link_map(store: Store, findings: list[Finding] | None = None, max_rows: int = 256,
             max_cols: int = 500) -> LinkMap:
    """The link x step table of a run (link_step.sql from its events), folded to at most max_rows x
    max_cols cells, with the network findings among `findings` placed on it."""
    if max_rows < 1 or max_cols < 1:
        raise ValueError("max_rows and max_cols must be >= 1")
    store.execute(load_sql("link_step"), {"async_ops": has_wait_spans(store), "wait_suffix": WAIT_SUFFIX})
    store.execute(load_sql("link_rows"), {"max_rows": int(max_rows)})
    cells = store.query(load_sql("link_cells"), {"max_cols": int(max_cols)})
    links = store.query("SELECT a, b, host_pair, row_bucket FROM link_rows ORDER BY row_bucket, a, b")
    if cells.empty:
        return LinkMap([], [], [], [])
    buckets = sorted(set(links.row_bucket))
    ri = {b: i for i, b in enumerate(buckets)}
    cols_by_bucket = cells.groupby("col_bucket").first_step.min()
    ci = {b: i for i, b in enumerate(cols_by_bucket.index)}
    rows, row_links, host_pairs = [], [], []
    for _, group in links.groupby("row_bucket", sort=True):
        first, last = group.iloc[0], group.iloc[-1]
        pairs = first.host_pair if first.host_pair == last.host_pair else f"{first.host_pair} .. {last.host_pair}"
        label = f"{pairs} · {first.a}-{first.b}"
        if len(group) > 1:
            label += f" .. {last.a}-{last.b} ({len(group)} links)"
        rows.append(label)
        row_links.append((int(first.a), int(first.b)))
        host_pairs.append(str(first.host_pair))
    r_idx = cells.row_bucket.map(ri).to_numpy()
    c_idx = cells.col_bucket.map(ci).to_numpy()
    values = {}
    for metric, column in _COLUMNS.items():
        grid = np.full((len(rows), len(ci)), np.nan)
        grid[r_idx, c_idx] = cells[column].to_numpy(dtype=float)
        values[metric] = grid
    out = LinkMap(rows, row_links, host_pairs, [int(c) for c in cols_by_bucket], values)
    row_of = {(int(a), int(b)): ri[bucket] for a, b, bucket in zip(links.a, links.b, links.row_bucket)}
    out.marks = [m for f in findings or [] if (m := _mark(f, row_of, out)) is not None]
    return out


def finding_links(finding: Finding) -> list[tuple[int, int]]:
    """The p2p links a network finding names (a < b): the lost-time attribution's and the flap
    detector's boundary findings list them in evidence["links"]; a per-link flap finding is its two
    ranks. [] for other kinds and for a collective group's finding (not a p2p link)."""
    if finding.kind not in NETWORK_KINDS:
        return []
    evidence = finding.evidence or {}
    if evidence.get("waits") == "collective" or evidence.get("group", "pp") != "pp":
        return []
    named = evidence.get("links") or ([finding.ranks] if len(finding.ranks) == 2 else [])
    return sorted({(min(int(x), int(y)), max(int(x), int(y))) for x, y in named})


def finding_episodes(finding: Finding) -> list[tuple[int, int]]:
    """Step ranges [first, last] of a finding's episodes (lost time: [[a, b], ...]; flaps: dicts with
    first_step and last_step), or its whole span when it lists none (a steady slow link)."""
    out = []
    for e in (finding.evidence or {}).get("episodes") or []:
        if isinstance(e, dict) and "first_step" in e:
            first = int(e["first_step"])
            out.append((first, int(e.get("last_step") or first)))
        elif isinstance(e, (list, tuple)) and len(e) == 2:
            out.append((int(e[0]), int(e[1])))
    return out or [(int(finding.steps[0]), int(finding.steps[1]))]


def _mark(finding: Finding, row_of: dict[tuple[int, int], int], view: LinkMap) -> LinkMark | None:
    rows = sorted({row_of[link] for link in finding_links(finding) if link in row_of})
    if not rows:
        return None
    spans = [(view.col_of(a), view.col_of(b)) for a, b in finding_episodes(finding)]
    return LinkMark(finding, rows, spans)
