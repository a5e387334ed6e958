"""DuckDB over a run directory: the views every analysis reads, and the SQL files that define them.

Views: `events`, `steps`, `gpu` (Parquet segments, all ranks), `topology` (from run.json).
Damaged segments (truncated, corrupt, foreign) are dropped from the views with a warning instead of
failing the whole analysis: the first query that trips on one names the file, we exclude it and retry.
After an elastic restart, `events` and `steps` (and every per-rank source) keep only the latest
attempt of each (rank, step) (attempts.py).
"""

from __future__ import annotations

import os
import re
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import duckdb
import pandas as pd
import pyarrow as pa

from megascope.analyzer import attempts
from megascope.tracer import run_dir as rd
from megascope.tracer.schema import TABLES, SchemaVersionError


class RunOpenError(RuntimeError):
    """The path is not a run directory megascope can read; the message says what to do."""


METADATA_CACHE_MAX_FILES = 20_000
"""Runs with more segments than this read Parquet footers without caching them."""
_FILE_IN_ERROR = re.compile(r"""['"]([^'"]+\.parquet)['"]""")


def load_sql(name: str) -> str:
    """Text of analyzer/sql/<name>.sql (one topic per file)."""
    return resources.files("megascope.analyzer.sql").joinpath(f"{name}.sql").read_text()


def _segments(root: Path, table: str) -> list[str]:
    """Complete segments of a table: RUN/<table>/rank=NNNNN/*.parquet, skipping temporary names."""
    base = root / table
    if not base.is_dir():
        return []
    out: list[str] = []
    with os.scandir(base) as ranks:
        for entry in ranks:
            if entry.is_dir() and entry.name.startswith("rank="):
                with os.scandir(entry.path) as files:
                    out.extend(f.path for f in files if f.name.endswith(".parquet") and not f.name.startswith("."))
    return sorted(out)


class Store:
    """One DuckDB connection with the run's views; `query` returns pandas DataFrames."""

    def __init__(self, path: str | Path, threads: int | None = None, memory_limit: str = "2.5GB") -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise RunOpenError(f"{self.path} does not exist; pass a run directory (the --run-dir of a "
                               "`megascope train` or the OUT of `megascope simulate`)")
        if not self.path.is_dir():
            raise RunOpenError(f"{self.path} is a file, not a run directory")
        try:
            self.manifest: dict[str, Any] = rd.read_manifest(self.path)
        except (FileNotFoundError, ValueError, SchemaVersionError) as exc:
            raise RunOpenError(str(exc)) from None
        self.warnings: list[str] = []
        self.con = duckdb.connect()
        self.con.execute(f"SET threads={threads or os.cpu_count() or 2}")
        self.con.execute("SET preserve_insertion_order=false")
        # bounded memory: past this DuckDB spills aggregations to disk instead of growing
        self.con.execute(f"SET memory_limit='{memory_limit}'")
        self._spill = tempfile.TemporaryDirectory(prefix="megascope-duckdb-")
        self.con.execute(f"SET temp_directory='{self._spill.name}'")
        self.topology = _topology_frame(self.manifest, self.path)
        self.con.register("_topology_df", self.topology)
        self.con.execute("CREATE TEMP TABLE topology AS SELECT * FROM _topology_df")
        self.con.unregister("_topology_df")
        self.files = {t: _segments(self.path, t) for t in TABLES}
        # cached footers make repeated queries (dashboard) faster, but on 10^5 segments the cache
        # (~20 KB a file) would take GBs for files the event pass reads once
        cache = sum(len(f) for f in self.files.values()) <= METADATA_CACHE_MAX_FILES
        self.con.execute(f"SET parquet_metadata_cache={'true' if cache else 'false'}")
        self._excluded: set[str] = set()
        self._folders: dict[str, tuple[int, dict[str, list[str]]]] = {}
        self.attempt_bounds = 0
        """Attempts after a rank's first (elastic restarts, attempts.py); when > 0 every events and
        steps source drops the rows of earlier attempts of a step."""
        times = attempts.restart_times_ns(self.path, self.manifest, self.warnings)
        scan_steps = bool(self.files["steps"]) and (times is not None or len(self.files["steps"]) <= attempts.SCAN_MAX_FILES)
        for table in TABLES:
            self._make_view(table)
            # big runs: the first scan (with retry) validates; the attempts scan validates steps
            if len(self.files[table]) <= 2000 and not (table == "steps" and scan_steps):
                self.run_with_retry(lambda: self.con.execute(f"SELECT count(*) FROM {table}").fetchall())
        if scan_steps:
            self._find_attempts(times)
        if not self.files["events"] and not self.files["steps"]:
            self.warnings.append("the run has no readable events or steps segments yet")

    def _find_attempts(self, restart_times: list[int] | None) -> None:
        """Per-rank restart bounds (attempts.py) from the unfiltered steps view; when there are any,
        the events and steps views are remade without the earlier attempts' rows. No restart recorded
        (None): only when some rank repeats a step."""
        if restart_times is None and not self.run_with_retry(lambda: attempts.repeats_steps(self.con, "steps")):
            return
        self.attempt_bounds = self.run_with_retry(lambda: attempts.build_bounds(self.con, "steps", restart_times or []))
        if self.attempt_bounds:
            for table in attempts.TIME_COLUMN:
                self._make_view(table)

    def _make_view(self, table: str) -> None:
        files = self.files[table]
        if not files:
            empty = TABLES[table].empty_table()
            self.con.register(f"_empty_{table}", empty)
            self.con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT * FROM _empty_{table}")
            return
        columns = ", ".join(f'"{f.name}"' for f in TABLES[table])
        if table in self._excluded:  # after dropping a damaged segment: the explicit list of the rest
            source = "[" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "]"
        else:  # a glob binds much faster than a list of 10^4-10^5 paths
            source = "'" + str(self.path / table).replace("'", "''") + "/rank=*/*.parquet'"
        self.con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS "
                         + self._latest(table, f"SELECT {columns} FROM read_parquet({source}, hive_partitioning=false)"))

    def _latest(self, table: str, select: str) -> str:
        """`select` over raw segments, less the rows of earlier attempts when the run restarted."""
        return attempts.latest_only(table, select) if self.attempt_bounds else select

    def run_with_retry(self, action: Callable[[], Any], attempts: int = 50) -> Any:
        """Run `action`; when DuckDB names a damaged segment, drop it from its view and retry."""
        for _ in range(attempts):
            try:
                return action()
            except (duckdb.IOException, duckdb.InvalidInputException, duckdb.BinderException,
                    duckdb.ConversionException) as exc:
                bad = self._culprit_file(str(exc))
                if bad is None:
                    raise
                table = next(t for t, fs in self.files.items() if bad in fs)
                self.files[table].remove(bad)
                self._excluded.add(table)
                self.warnings.append(f"skipped damaged segment {os.path.relpath(bad, self.path)}: "
                                     f"{str(exc).splitlines()[0][:160]}")
                self._make_view(table)
        raise RunOpenError(f"{self.path}: too many damaged segments; check the disk the run was written to")

    def _culprit_file(self, message: str) -> str | None:
        for match in _FILE_IN_ERROR.finditer(message):
            candidate = match.group(1)
            for files in self.files.values():
                if candidate in files:
                    return candidate
        for files in self.files.values():  # message without quotes: search by path substring
            for f in files:
                if f in message:
                    return f
        return None

    def events_source(self, ranks: list[int] | None) -> str:
        """SQL source of the events of some ranks: only their segments are opened (files are per rank),
        which makes rank-filtered queries on 10^4-rank runs cheap. None = the `events` view."""
        return self.table_source("events", ranks)

    def table_source(self, table: str, ranks: list[int] | None) -> str:
        """SQL source of one table (events, steps, gpu) restricted to some ranks' segment folders."""
        if ranks is None or len(ranks) > 4096:
            return table
        by_folder = self._by_folder(table)
        files = [f for r in sorted(set(int(x) for x in ranks))
                 for f in by_folder.get(rd.table_dir(self.path, table, r).name, [])]
        if not files:
            return f"(SELECT * FROM {table} WHERE false)"
        columns = ", ".join(f'"{f.name}"' for f in TABLES[table])
        listing = "[" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "]"
        return f"({self._latest(table, f'SELECT {columns} FROM read_parquet({listing}, hive_partitioning=false)')})"

    def _by_folder(self, table: str) -> dict[str, list[str]]:
        """Segments of a table by rank folder name (rank=NNNNN), built once per table and file list."""
        cached = self._folders.get(table)
        if cached is None or cached[0] != len(self.files[table]):
            index: dict[str, list[str]] = {}
            for f in self.files[table]:
                index.setdefault(os.path.basename(os.path.dirname(f)), []).append(f)
            cached = (len(self.files[table]), index)
            self._folders[table] = cached
        return cached[1]

    def rank_prefix_batches(self, batch_ranks: int, tables: tuple[str, ...] = ("events", "steps")
                            ) -> list[list[str]] | None:
        """Batches of about `batch_ranks` ranks as rank-folder name patterns (rank=00???: ranks 0-999;
        fewer wildcards for smaller batches), the same ranks for every table, so a batch joins its
        events with its own steps; globs over patterns bind much faster than lists of 10^4 paths.
        None: a small run, one batch (the views). Turn a batch into SQL with `batch_source` inside the
        action given to run_with_retry: a damaged segment found mid-pass changes the source."""
        dirs = sorted({os.path.basename(os.path.dirname(f)) for t in tables for f in self.files[t]})
        if len(dirs) <= batch_ranks:
            return None
        wild = max(0, min(3, len(str(batch_ranks)) - 1))  # 1024 -> 3 digits (1000 ranks a pattern)
        by_pattern: dict[str, int] = {}
        for name in dirs:
            pattern = name[:len(name) - wild] + "?" * wild
            by_pattern[pattern] = by_pattern.get(pattern, 0) + 1
        batches: list[list[str]] = [[]]
        count = 0
        for pattern, n in by_pattern.items():
            if count and count + n > batch_ranks:
                batches.append([])
                count = 0
            batches[-1].append(pattern)
            count += n
        return batches

    def batch_source(self, table: str, patterns: list[str] | None) -> str:
        """SQL source of one table's segments in the rank folders matching `patterns` (one batch of
        rank_prefix_batches; None: all, the table's view)."""
        if patterns is None:
            return table
        wild = patterns[0].count("?")  # the patterns of one batch share their width
        stems = {p[:len(p) - wild]: p for p in patterns}
        folders = {name for name in self._by_folder(table) if name[:len(name) - wild] in stems}
        if not folders:
            return f"(SELECT * FROM {table} WHERE false)"
        columns = ", ".join(f'"{f.name}"' for f in TABLES[table])
        if table in self._excluded or not wild:  # the files themselves (a damaged one was dropped)
            by_folder = self._by_folder(table)
            listing = ", ".join("'" + f.replace("'", "''") + "'" for name in sorted(folders) for f in by_folder[name])
        else:
            root = str(self.path / table).replace("'", "''")
            used = sorted({stems[name[:len(name) - wild]] for name in folders})
            listing = ", ".join(f"'{root}/{p}/*.parquet'" for p in used)
        return f"({self._latest(table, f'SELECT {columns} FROM read_parquet([{listing}], hive_partitioning=false)')})"

    def query(self, sql: str, params: dict | list | None = None) -> pd.DataFrame:
        return self.run_with_retry(lambda: self.con.execute(sql, params or {}).df())

    def execute(self, sql: str, params: dict | list | None = None) -> None:
        self.run_with_retry(lambda: self.con.execute(sql, params or {}))

    def arrow(self, sql: str, params: dict | list | None = None) -> pa.Table:
        return self.run_with_retry(lambda: self.con.execute(sql, params or {}).arrow())


def _topology_frame(manifest: dict, path: Path) -> pd.DataFrame:
    topo = manifest.get("topology") or {}
    ranks = topo.get("ranks")
    if not ranks:
        raise RunOpenError(f"{path}/run.json has no topology.ranks; it was not written by megascope")
    frame = pd.DataFrame(ranks)
    for col, default in (("host", "localhost"), ("local_rank", 0)):
        if col not in frame:
            frame[col] = default
    frame = frame[["rank", "pp", "dp", "tp", "host", "local_rank"]].copy()
    for col in ("rank", "pp", "dp", "tp", "local_rank"):
        frame[col] = frame[col].astype("int32")
    frame["host"] = frame["host"].astype(str)
    return frame.sort_values("rank").reset_index(drop=True)
