"""The per-rank-step summary persisted in the run directory, so a heatmap over a big run does not
rerun the event pass (a scan of every event) each time the run is opened.

    RUN/analysis/rank_step.parquet   rank_step's columns (sql/rank_step.sql) + late_count, lateness_s
                                     (sql/arrivals.sql) per rank and step; written by the analyzer only

The file's Parquet key-value metadata says what it was built from: the relative paths of the events
and steps segments, the analyzer SQL it was built with, the topology, and the event-pass settings.
Segments are immutable once renamed into place (tracer/sink.py), so their names identify their content:
- the same segments -> the file is reused (a view over it; nothing is scanned);
- only new segments (a live run) -> the steps from the first step the new segments touch are rebuilt
  from the events of those steps only (the event pass is windowed per rank and step, so older steps
  are unaffected) and merged with the older rows;
- anything else (a segment gone or damaged, other SQL, another topology) -> a full rebuild.
The file is written under a temporary name and renamed, so readers never see half of it. A run
directory that cannot be written to keeps the summary in memory (with a warning).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from megascope.analyzer.event_pass import (BATCH_RANKS, COLLECTIVE_COLUMNS, RANK_COLUMNS, SIMPLE_GAP_SQL,
                                           TIMELINE_ALWAYS_RANKS, TIMELINE_GAP_SQL, needs_timeline, pass_sql,
                                           run_start_ns)
from megascope.analyzer.store import Store, load_sql

SUMMARY_VIEW = "rank_step_summary"
"""The relation the heatmap reads: rank_step's columns plus late_count and lateness_s."""
ANALYSIS_DIR = "analysis"
SUMMARY_FILE = "rank_step.parquet"
MIN_LATENESS_S = "1e-4"  # as Run._ensure("collectives"): arrivals later than this count as late
_META_KEY = b"megascope.summary"
_SQL_FILES = ("event_pass", "rank_step", "collectives", "arrivals")
_SUMMARY_SELECT = """SELECT rs.*, coalesce(la.late_count, 0)::BIGINT AS late_count, la.lateness_s
    FROM {rank_step} rs LEFT JOIN {late} la USING (rank, step)"""


@dataclass
class SummaryState:
    how: str
    """'reused' (file up to date), 'extended' (new steps added), 'built' (full event pass) or 'memory'."""
    path: Path | None
    """The Parquet file behind the view, None when it could not be written."""
    rebuilt_from_step: int | None = None


def summary_path(store: Store) -> Path:
    return store.path / ANALYSIS_DIR / SUMMARY_FILE


def ensure_summary(store: Store, build_tables: Callable[[], None], tables_built: bool = False,
                   progress=None) -> SummaryState:
    """Define the view `rank_step_summary`, from the persisted file when it matches the run's segments.

    `build_tables()` makes the temp tables rank_step and late_arrivals with the full event pass (the
    Run's own build); `tables_built`: the Run has them already, so a stale file is rewritten from them
    rather than extended."""
    path = summary_path(store)
    current = _segments(store)
    cached = read_meta(path)
    if cached is not None and cached.get("fingerprint") == _fingerprint(store):
        old = set(_decode(cached["segments"]))
        if old == set(current):
            _view(store, path)
            return SummaryState("reused", path)
        new = [s for s in current if s not in old]
        if not tables_built and old <= set(current) and (first := _first_step(store, new)) is not None:
            _extend(store, path, cached, first, progress)
            return _persist(store, path, current, bool(cached["timeline"]), "extended", first)
    build_tables()
    timeline = len(store.topology) <= TIMELINE_ALWAYS_RANKS or needs_timeline(store, run_start_ns(store))
    store.execute("CREATE OR REPLACE TEMP TABLE _summary_rows AS "
                  + _SUMMARY_SELECT.format(rank_step="rank_step", late="late_arrivals"))
    return _persist(store, path, current, timeline, "built")


def read_meta(path: Path) -> dict | None:
    """The build record of a summary file, None when there is none (or it is unreadable)."""
    try:
        meta = pq.read_schema(path).metadata or {}
        return json.loads(meta[_META_KEY])
    except (OSError, KeyError, ValueError):
        return None


def write_summary(store: Store, relation: str, timeline: bool = True, path: Path | None = None) -> Path:
    """Write `relation` (rank_step_summary's columns) as the summary of the run's current segments.
    Used after a build, and by benchmarks that synthesize a summary with the same schema."""
    path = path or summary_path(store)
    meta = {"fingerprint": _fingerprint(store), "timeline": timeline,
            "segments": _encode(_segments(store))}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    literal = json.dumps(meta).replace("'", "''")
    try:  # DuckDB writes it (streaming; 10^7 rows would not fit in memory as one Arrow table)
        store.execute(f"COPY (SELECT * FROM {relation} ORDER BY step, rank) TO '{_quote(tmp)}' "
                      f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE 262144, "
                      f"KV_METADATA {{'{_META_KEY.decode()}': '{literal}'}})")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _persist(store: Store, path: Path, segments: list[str], timeline: bool, how: str,
             first: int | None = None) -> SummaryState:
    try:
        if _segments(store) != segments:  # the pass dropped a damaged segment: record what it read
            segments = _segments(store)
        write_summary(store, "_summary_rows", timeline, path)
    except OSError as exc:
        store.warnings.append(f"could not save the rank-step summary to {path} ({exc.strerror or exc}); "
                              "it is kept in memory for this session")
        store.execute(f"CREATE OR REPLACE TEMP VIEW {SUMMARY_VIEW} AS SELECT * FROM _summary_rows")
        return SummaryState("memory", None, first)
    store.execute("DROP TABLE IF EXISTS _summary_rows")
    _view(store, path)
    return SummaryState(how, path, first)


def _view(store: Store, path: Path) -> None:
    store.execute(f"CREATE OR REPLACE TEMP VIEW {SUMMARY_VIEW} AS SELECT * FROM read_parquet('{_quote(path)}')")


def _quote(path: Path | str) -> str:
    return str(path).replace("'", "''")


def _extend(store: Store, path: Path, cached: dict, first: int, progress=None) -> None:
    """_summary_rows = the file's rows before step `first` + those from `first` on, rebuilt from the
    events of those steps only (under private names: the Run's own tables are left alone)."""
    base = run_start_ns(store)
    timeline = bool(cached["timeline"])
    batches = store.rank_batches(BATCH_RANKS)
    for i, source in enumerate(batches):
        if progress is not None:
            progress("updating the rank-step summary", i, len(batches))
        recent = f"(SELECT * FROM {source} WHERE step >= {int(first)})"
        verb = "CREATE OR REPLACE TEMP TABLE {} AS " if i == 0 else "INSERT INTO {} "
        store.execute("CREATE OR REPLACE TEMP TABLE _summary_batch AS " + pass_sql(store, recent, base, timeline))
        store.execute(verb.format("_summary_peer_step") + f"SELECT {RANK_COLUMNS} FROM _summary_batch WHERE gset = 0")
        store.execute(verb.format("_summary_partials") + f"SELECT {COLLECTIVE_COLUMNS} FROM _summary_batch "
                      "WHERE gset = 1 AND instance IS NOT NULL")
    store.execute("DROP TABLE IF EXISTS _summary_batch")
    rank_step = _renamed(_renamed(load_sql("rank_step"), "TEMP TABLE rank_step AS", "TEMP TABLE _summary_rank_step AS"),
                         "FROM _rank_peer_step", "FROM _summary_peer_step")
    store.execute(rank_step.replace("{gap}", TIMELINE_GAP_SQL if timeline else SIMPLE_GAP_SQL))
    collectives = _renamed(_renamed(load_sql("collectives"), "TEMP TABLE collective_instances AS",
                                    "TEMP TABLE _summary_collectives AS"),
                           "FROM _collective_partials", "FROM _summary_partials")
    store.execute(collectives.format(base=base))
    arrivals = _renamed(load_sql("arrivals"), "FROM collective_instances", "FROM _summary_collectives")
    store.execute("CREATE OR REPLACE TEMP TABLE _summary_late AS " +
                  arrivals.rstrip().rstrip(";").replace("$min_lateness_s", MIN_LATENESS_S))
    store.execute(f"""CREATE OR REPLACE TEMP TABLE _summary_rows AS
        SELECT * FROM read_parquet('{_quote(path)}') WHERE step < {int(first)}
        UNION ALL BY NAME
        SELECT * FROM ({_SUMMARY_SELECT.format(rank_step="_summary_rank_step", late="_summary_late")})
        WHERE step >= {int(first)}""")
    for table in ("_summary_rank_step", "_summary_collectives", "_summary_late", "_summary_peer_step",
                  "_summary_partials"):
        store.execute(f"DROP TABLE IF EXISTS {table}")


def _renamed(sql: str, old: str, new: str) -> str:
    if old not in sql:  # the analyzer's SQL changed shape: say so rather than clobber its tables
        raise RuntimeError(f"summary_cache: expected '{old}' in the analyzer SQL; update summary_cache.py")
    return sql.replace(old, new)


def _first_step(store: Store, new: list[str]) -> int | None:
    """First step any new segment holds (None: nothing new has a step, nothing to rebuild)."""
    listing = ", ".join(f"'{_quote(store.path / s)}'" for s in new)
    row = store.query(f"SELECT min(step) AS s FROM read_parquet([{listing}], union_by_name=true)")
    value = row.s.iloc[0] if len(row) else None
    return None if value is None or value != value else int(value)


def _segments(store: Store) -> list[str]:
    """Relative paths of the events and steps segments the run has now (sorted)."""
    root = str(store.path) + os.sep
    return sorted(f[len(root):] if f.startswith(root) else f
                  for table in ("events", "steps") for f in store.files[table])


def _fingerprint(store: Store) -> str:
    """What besides the segments the summary depends on: the analyzer's SQL and the topology."""
    h = hashlib.sha256()
    for name in _SQL_FILES:
        h.update(load_sql(name).encode())
    h.update(json.dumps(store.manifest.get("topology"), sort_keys=True, default=str).encode())
    h.update(json.dumps(store.manifest.get("peak_flops"), sort_keys=True, default=str).encode())
    return h.hexdigest()


def _encode(names: list[str]) -> str:
    return base64.b64encode(zlib.compress("\n".join(names).encode(), 6)).decode()


def _decode(blob: str) -> list[str]:
    text = zlib.decompress(base64.b64decode(blob)).decode()
    return text.split("\n") if text else []
