"""The per-rank-step summary persisted in the run directory, so a heatmap over a big run does not
rerun the event pass (a scan of every event) each time the run is opened.

    RUN/analysis/rank_step/manifest.json          what the summary was built from, and its parts
    RUN/analysis/rank_step/part-<id>.parquet      rank_step's columns (tracer/sql/rank_step.sql) + late_count,
                                                  lateness_s (sql/arrivals.sql), one row per rank and step

The manifest records the relative paths of the events and steps segments the summary came from,
a hash of the analyzer SQL, the topology and peak FLOP/s, and each part's step range. Segments are
immutable once renamed into place (tracer/sink.py), so their names identify their content:
- the same segments -> reused (a view over the parts; no event is read);
- only new segments (a live run) -> the steps from the first step the new segments hold are rebuilt
  from the events of those steps only (the event pass is windowed per rank and step, so older steps
  are unaffected) and written as a new part; older parts are kept (the one straddling that step is
  cut), so a refresh writes only what changed; past MAX_PARTS the parts are merged into one;
- anything else (a segment gone or damaged, other SQL, another topology) -> a full rebuild.
Parts are written under temporary names and renamed, then the manifest is replaced atomically, so a
reader sees the old summary or the new one; parts no manifest names are deleted once older than
GC_AGE_S (a reader may still be scanning them). A run directory that cannot be written to keeps
the summary in memory (with a warning). Only the analyzer writes here; deleting it is always safe.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from megascope.analyzer.data import event_pass as ep
from megascope.analyzer.data.store import Store
from megascope.tracer.run_dir import write_json_atomic

SUMMARY_VIEW = "rank_step_summary"
"""The relation the heatmap reads: rank_step's columns plus late_count and lateness_s."""
SUMMARY_DIR = Path("analysis") / "rank_step"
MANIFEST = "manifest.json"
FORMAT_VERSION = 2
"""2: rank-steps of damaged segments are left out (event_pass.drop_incomplete); v1 summaries held them."""
MAX_PARTS = 32
GC_AGE_S = 600.0
SUMMARY_TABLES = ep.PassTables("_summary_rank_step", None, "_summary_partials", "_summary_collectives")
"""Where the extension's batches accumulate (the Run's own tables are left alone)."""


@dataclass
class SummaryState:
    how: str
    """'reused' (up to date), 'extended' (new steps added), 'built' (full event pass) or 'memory'."""
    path: Path | None
    """The summary's folder, None when it could not be written."""
    rebuilt_from_step: int | None = None
    parts: int = 0


def summary_dir(store: Store) -> Path:
    return store.path / SUMMARY_DIR


def read_manifest(folder: Path) -> dict | None:
    """The summary's manifest, None when there is none, it is unreadable or of another format."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("version") == FORMAT_VERSION else None


def ensure_summary(store: Store, build_tables: Callable[[], bool], tables_built: bool = False,
                   progress=None) -> SummaryState:
    """Define the view `rank_step_summary`, from the persisted parts when they match the run.

    `build_tables()` makes the temp tables rank_step and late_arrivals with the full event pass (the
    Run's own build) and says whether their rows are the timeline variant's (the edge summaries'
    are), which a live run's extension then takes too; `tables_built`: the Run has them already, so
    a stale summary is rewritten from them rather than extended."""
    folder = summary_dir(store)
    current = _segments(store)
    manifest = read_manifest(folder)
    if manifest is not None and manifest.get("fingerprint") == _fingerprint(store) \
            and all((folder / p["file"]).is_file() for p in manifest["parts"]):
        old = _decode(manifest["segments"])
        if old == current:
            _view(store, [folder / p["file"] for p in manifest["parts"]])
            return SummaryState("reused", folder, parts=len(manifest["parts"]))
        new = sorted(set(current) - set(old))
        if not tables_built and set(old) <= set(current) and (first := _first_step(store, new)) is not None:
            _rebuild_from(store, first, bool(manifest["timeline"]), progress)
            return _save(store, folder, manifest, bool(manifest["timeline"]), first)
    timeline = build_tables()
    _summary_rows(store, "rank_step", "late_arrivals", ep.NO_FIRST_STEP)
    return _save(store, folder, None, timeline, None)


def is_current(store: Store) -> bool:
    """Whether the persisted summary matches the run's segments and this analyzer's SQL (so opening
    the run reuses it without reading events)."""
    folder = summary_dir(store)
    manifest = read_manifest(folder)
    return (manifest is not None and manifest.get("fingerprint") == _fingerprint(store)
            and all((folder / p["file"]).is_file() for p in manifest["parts"])
            and _decode(manifest["segments"]) == _segments(store))


def write_summary(store: Store, relation: str, timeline: bool = True) -> Path:
    """Write `relation` (rank_step_summary's columns) as the whole summary of the run's current
    segments, in one part. Used by benchmarks that synthesize a summary with the same schema."""
    folder = summary_dir(store)
    folder.mkdir(parents=True, exist_ok=True)
    _commit(store, folder, timeline, [_write_part(store, f"SELECT * FROM {relation}", folder)])
    return folder


def _save(store: Store, folder: Path, manifest: dict | None, timeline: bool, first: int | None) -> SummaryState:
    """Persist _summary_rows (all rows after a build, rows from step `first` on after an extension)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        parts = []
        for part in (manifest or {}).get("parts", []) if first is not None else []:
            if part["last"] < first:
                parts.append(part)
            elif part["first"] < first:  # the part straddling the first rebuilt step: keep its older rows
                parts.append(_write_part(store, "SELECT * FROM read_parquet($files) WHERE step < $first", folder,
                                         {"files": [str(folder / part["file"])], "first": first}))
        parts.append(_write_part(store, "SELECT * FROM _summary_rows", folder))
        if len(parts) > MAX_PARTS:
            parts = [_write_part(store, "SELECT * FROM read_parquet($files)", folder,
                                 {"files": [str(folder / p["file"]) for p in parts]})]
        _commit(store, folder, timeline, parts)
    except OSError as exc:
        store.warnings.append(f"could not save the rank-step summary in {folder} ({exc.strerror or exc}); "
                              "it is kept in memory for this session")
        if first is not None and manifest is not None:  # the older rows come from the parts still on disk
            store.execute("""CREATE OR REPLACE TEMP TABLE _summary_rows AS
                SELECT * FROM read_parquet($files) WHERE step < $first
                UNION ALL BY NAME SELECT * FROM _summary_rows""",
                          {"files": [str(folder / p["file"]) for p in manifest["parts"]], "first": first})
        store.execute(f"CREATE OR REPLACE TEMP VIEW {SUMMARY_VIEW} AS SELECT * FROM _summary_rows")
        return SummaryState("memory", None, first)
    store.execute("DROP TABLE IF EXISTS _summary_rows")
    _view(store, [folder / p["file"] for p in parts])
    return SummaryState("built" if first is None else "extended", folder, first, len(parts))


def _write_part(store: Store, select: str, folder: Path, params: dict | None = None) -> dict:
    """One Parquet part (sorted by step, zstd) of `select` (with its bound `params`), written to a
    temporary name and renamed."""
    name = f"part-{uuid.uuid4().hex[:16]}.parquet"
    tmp = folder / f".{name}.tmp"
    try:  # DuckDB writes it streaming: 10^7 rows would not fit in memory as one Arrow table
        store.execute(f"COPY ({select} ORDER BY step, rank) TO $part "
                      "(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE 262144)", {**(params or {}), "part": str(tmp)})
        os.replace(tmp, folder / name)
    finally:
        tmp.unlink(missing_ok=True)
    row = store.query("SELECT min(step) AS a, max(step) AS b FROM read_parquet($file)", {"file": str(folder / name)})
    first, last = row.a.iloc[0], row.b.iloc[0]
    empty = bool(pd.isna(first))  # no rows: NULL comes back as None, NaN or pd.NA by dtype
    return {"file": name, "first": -1 if empty else int(first), "last": -1 if empty else int(last)}


def _commit(store: Store, folder: Path, timeline: bool, parts: list[dict]) -> None:
    """Replace the manifest (the moment the new summary becomes the summary), then collect garbage."""
    write_json_atomic(folder / MANIFEST, {"version": FORMAT_VERSION, "fingerprint": _fingerprint(store),
                                          "timeline": timeline, "segments": _encode(_segments(store)),
                                          "parts": parts})
    named = {p["file"] for p in parts} | {MANIFEST}
    now = time.time()
    for entry in os.scandir(folder):
        if entry.name not in named and now - entry.stat().st_mtime > GC_AGE_S:
            Path(entry.path).unlink(missing_ok=True)


def _view(store: Store, files: list[Path]) -> None:
    # a view keeps its text (no bound parameters): the parts' paths are quoted into it
    listing = ", ".join(f"'{_quote(f)}'" for f in files)
    store.execute(f"CREATE OR REPLACE TEMP VIEW {SUMMARY_VIEW} AS SELECT * FROM read_parquet([{listing}])")


def _quote(path: Path | str) -> str:
    return str(path).replace("'", "''")


def _rebuild_from(store: Store, first: int, timeline: bool, progress=None) -> None:
    """_summary_rows = the summary's rows from step `first` on, built as the event pass builds them
    (event_pass.py's batch loop, SQL and gap rule) from the events and steps of those steps only,
    into private tables: the Run's own rank_step and collective_instances are left alone."""
    plan = ep.plan_pass(store, timeline=timeline, first_step=first)
    ep.run_batches(store, plan, SUMMARY_TABLES, progress=progress, label="updating the rank-step summary")
    ep.drop_incomplete(store, "_summary_rank_step", None, "_summary_collectives")
    ep.late_arrivals(store, "_summary_collectives", "_summary_late")
    _summary_rows(store, "_summary_rank_step", "_summary_late", first)
    for table in ("_summary_rank_step", "_summary_rank_step_incomplete", "_summary_collectives", "_summary_late",
                  "_summary_partials"):
        store.execute(f"DROP TABLE IF EXISTS {table}")


def _summary_rows(store: Store, rank_step: str, late: str, first: int) -> None:
    """The temp table _summary_rows: rank_step_summary.sql over the tables `rank_step` and `late`."""
    ep.define_sql(store)
    store.execute("CREATE OR REPLACE TEMP TABLE _summary_rows AS FROM rank_step_summary_of($rank_step, $late, $first)",
                  {"rank_step": rank_step, "late": late, "first": int(first)})


def _first_step(store: Store, new: list[str]) -> int | None:
    """First step any new segment holds (None: no step in them; a rebuild decides)."""
    row = store.query("SELECT min(step) AS s FROM read_parquet($files, union_by_name=true)",
                      {"files": [str(store.path / s) for s in new]})
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
    for text in ep.library_sql():
        h.update(text.encode())
    h.update(json.dumps(store.manifest.get("topology"), sort_keys=True, default=str).encode())
    h.update(json.dumps(store.manifest.get("peak_flops"), sort_keys=True, default=str).encode())
    return h.hexdigest()


def _encode(names: list[str]) -> str:
    return base64.b64encode(zlib.compress("\n".join(names).encode(), 6)).decode()


def _decode(blob: str) -> list[str]:
    text = zlib.decompress(base64.b64decode(blob)).decode()
    return text.split("\n") if text else []
