"""Steps run twice across an elastic restart: where each attempt of a rank begins, so the store's
views keep only the latest attempt of every (rank, step).

After a crash the whole worker group restores the last checkpoint and re-runs the steps since it; the
restarted tracer appends segments (tracer/sink.py), so a (rank, step) can appear twice, and the
crashed attempt may have left a partial step (events, no steps row). Mixing both makes a re-run step
look seconds long (a bogus late launch or straggler at the resumed steps).

The rule, per rank, over its steps rows in start order: a row begins a new attempt when its step does
not follow the previous row's (step <= previous step) or a restart (RUN/incidents.jsonl) happened
between the previous row's end and its own end. That gives a bound (rank, from_step, before_ns): rows
of the rank with step >= from_step that happened before before_ns belong to an earlier attempt and
are dropped. before_ns is the restart time when one is known (every event of the new attempt follows
it, including any issued before its first steps row), else the new row's start, and never later than
that start (the driver's clock and the tracer's aligned clock may differ by a little).

Cost: the bounds come from the steps table (one row per rank and step), read only when run.json
records restarts, incidents.jsonl a restart, or the run is small (its steps are scanned at open
anyway); a run without restarts gets no table and unchanged views. Not covered: a restart whose
attempt never completed a step (its partial steps stay mixed with the previous attempt's), and a
manual re-run of a big run into the same run directory (nothing records it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb

from megascope.tracer.run_dir import INCIDENTS_FILE

BOUNDS = "_attempt_bounds"
"""Temp table (rank, from_step, before_ns): one row per attempt after a rank's first."""
SCAN_MAX_FILES = 2000
"""Runs with at most this many steps segments are checked for repeated steps even without a
recorded restart (a manual re-run into the same run directory records none)."""
TIME_COLUMN = {"events": "coalesce(_r.issue_ns, _r.start_ns)", "steps": "_r.start_ns"}
"""When a row happened, per table filtered. gpu samples and kernels carry no step: a sample of the
crashed attempt is not a duplicate of anything, so they are kept."""

_BOUNDS_SQL = """
CREATE OR REPLACE TEMP TABLE {bounds} AS
WITH _rows AS (
    SELECT rank, step, start_ns, end_ns,
           lag(step) OVER (PARTITION BY rank ORDER BY start_ns, step) AS prev_step,
           lag(end_ns) OVER (PARTITION BY rank ORDER BY start_ns, step) AS prev_end
    FROM (SELECT rank, step, start_ns, end_ns FROM {steps} WHERE step IS NOT NULL AND start_ns IS NOT NULL)
), _restarts AS (
    SELECT unnest($times::BIGINT[]) AS t
), _firsts AS (  -- the latest restart between the previous row's end and this row's end
    SELECT r.rank, r.step, r.start_ns, r.prev_step, max(x.t) AS t
    FROM _rows r LEFT JOIN _restarts x
      ON x.t > coalesce(r.prev_end, -9223372036854775807) AND x.t <= coalesce(r.end_ns, r.start_ns)
    GROUP BY ALL
)
SELECT rank::INTEGER AS rank, step::BIGINT AS from_step, least(coalesce(t, start_ns), start_ns)::BIGINT AS before_ns
FROM _firsts
WHERE step <= prev_step OR t IS NOT NULL
"""


def restart_times_ns(path: Path, manifest: dict[str, Any], warnings: list[str]) -> list[int] | None:
    """Times (epoch ns) of the restarts RUN/incidents.jsonl records; None when nothing says the run
    restarted (no restart incident, no `restarts` in run.json): the cheap trigger, no segment read."""
    times: list[int] = []
    incidents = path / INCIDENTS_FILE
    if incidents.is_file():
        for line in incidents.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by a crash of the writer (incidents.py reports it)
                continue
            if isinstance(row, dict) and row.get("kind") == "restart" and isinstance(row.get("time"), (int, float)):
                times.append(int(row["time"] * 1e9))
    if times:
        return sorted(times)
    try:
        restarted = int(manifest.get("restarts") or 0) > 0
    except (TypeError, ValueError):
        restarted = False
    if restarted:
        warnings.append("run.json records restarts but incidents.jsonl none: attempts are told apart by "
                        "their step numbers only")
        return []
    return None


def repeats_steps(con: duckdb.DuckDBPyConnection, steps: str) -> bool:
    """Does any rank hold a step twice? The check of runs with no recorded restart: cheaper than the
    bounds (a hash aggregate, no window), and a restart always repeats its resumed step (it resumes at
    or after the step the previous attempt started from, and that attempt's flushed rows are contiguous)."""
    return bool(con.execute(f"SELECT 1 FROM {steps} GROUP BY rank, step HAVING count(*) > 1 LIMIT 1").fetchall())


def build_bounds(con: duckdb.DuckDBPyConnection, steps: str, times: list[int]) -> int:
    """Create the BOUNDS table from `steps` (a relation with rank, step, start_ns, end_ns: the
    unfiltered steps) and the restart times; returns its number of rows (0: one attempt per rank)."""
    con.execute(_BOUNDS_SQL.format(bounds=BOUNDS, steps=steps), {"times": [int(t) for t in times]})
    row = con.execute(f"SELECT count(*) FROM {BOUNDS}").fetchone()
    assert row is not None  # an aggregate without GROUP BY returns one row
    return int(row[0])


def latest_only(table: str, select: str) -> str:
    """`select` (rows of `table`, with its rank, step and time columns) without the rows of earlier
    attempts: an anti join on rank against the small BOUNDS table."""
    time = TIME_COLUMN.get(table)
    if time is None:
        return select
    return (f"SELECT _r.* FROM ({select}) _r WHERE NOT EXISTS (SELECT 1 FROM {BOUNDS} _b "
            f"WHERE _b.rank = _r.rank AND _r.step >= _b.from_step AND {time} < _b.before_ns)")
