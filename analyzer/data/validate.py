"""Segments that contradict the run, said instead of swallowed: checked when a Store opens a run.

- a column of another type than the schema's (a `rank` written as text, as a DuckDB `COPY` from a
  hive-partitioned read produces): read cast to the schema's type (rows whose value does not convert
  are left out as naming no rank);
- rows naming a rank outside run.json's topology: left out;
- rows that end before they start (`end_ns < start_ns`): left out.

The segment itself is never changed: the Store's views read a corrected copy of it in the Store's
temporary folder instead. Each problem is one warning line naming the segment and the count, and the
rank-steps whose rows were left out are incomplete data (`Contradiction`, Store.incomplete_ranges):
the event pass keeps them out of what the detectors read and the report lists them.

Checked on runs of up to MAX_FILES segments per table, like the Store's first validation scan: the
row checks read every row's rank, step and times once (cheap next to the event pass at that size).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from megascope.tracer.schema import TABLES

MAX_FILES = 2000
"""Tables with more segments than this are not checked (the Store's own validation scan stops there)."""
_PHYSICAL = {pa.int8(): "INT32", pa.int16(): "INT32", pa.int32(): "INT32", pa.int64(): "INT64",
             pa.float32(): "FLOAT", pa.float64(): "DOUBLE", pa.string(): "BYTE_ARRAY", pa.bool_(): "BOOLEAN"}
_SQL_TYPE = {pa.int8(): "TINYINT", pa.int16(): "SMALLINT", pa.int32(): "INTEGER", pa.int64(): "BIGINT",
             pa.float32(): "FLOAT", pa.float64(): "DOUBLE", pa.string(): "VARCHAR", pa.bool_(): "BOOLEAN"}


@dataclass
class Contradiction:
    """Rows of one segment left out: the rank-steps they belonged to are incomplete data."""
    rank: int
    first_step: int
    last_step: int
    segment: str
    """Relative path of the original segment."""


def check(con: duckdb.DuckDBPyConnection, root: Path, files: dict[str, list[str]], ranks: list[int],
          scratch: Path, warnings: list[str]) -> tuple[dict[str, str], list[Contradiction]]:
    """Check every table's segments (`files`, table -> paths) against its schema and the topology's
    `ranks`; write a corrected copy of each contradicting one under `scratch`. Returns the copies
    (original path -> copy) and the rows left out; appends one line per problem to `warnings`."""
    copies: dict[str, str] = {}
    left_out: list[Contradiction] = []
    for table, paths in files.items():
        if not paths or len(paths) > MAX_FILES:
            continue
        try:
            mistyped = _mistyped(con, paths, TABLES[table])
            bad = _bad_rows(con, paths, TABLES[table], ranks, mistyped)
        except duckdb.Error:  # a damaged segment (unreadable): the Store's to find, drop and name
            continue
        for path, count, outside, backwards, steps in bad:
            rel = os.path.relpath(path, root)
            for column, found in mistyped.get(path, {}).items():
                warnings.append(f"{rel}: column {column} is {found}, not {_SQL_TYPE[TABLES[table].field(column).type]} "
                                f"as the schema says (docs/schema.md); its {count} row(s) were read cast to it")
            if outside:
                warnings.append(f"{rel}: {outside} row(s) name a rank outside run.json's topology (ranks "
                                f"{min(ranks)}-{max(ranks)}) and were left out")
            if backwards:
                warnings.append(f"{rel}: {backwards} row(s) end before they start (end_ns < start_ns) and were "
                                "left out")
            if (outside or backwards) and table in ("events", "steps"):  # the tables rank-steps come from
                left_out.append(Contradiction(_folder_rank(path), steps[0], steps[1], rel))
            copies[path] = _write_copy(con, path, TABLES[table], ranks, mistyped.get(path, {}), scratch / rel)
    return copies, left_out


def _mistyped(con: Any, paths: list[str], schema: pa.Schema) -> dict[str, dict[str, str]]:
    """path -> {column: physical type found} for columns stored with another physical type."""
    expected = {f.name: _PHYSICAL.get(f.type) for f in schema}
    rows = con.execute("SELECT file_name, name, type FROM parquet_schema($files) WHERE type IS NOT NULL",
                       {"files": paths}).fetchall()
    out: dict[str, dict[str, str]] = {}
    for path, name, physical in rows:
        want = expected.get(name)
        if want is not None and physical != want:
            out.setdefault(path, {})[name] = "text" if physical == "BYTE_ARRAY" else physical
    return out


def _bad_rows(con: Any, paths: list[str], schema: pa.Schema, ranks: list[int],
              mistyped: dict[str, dict[str, str]]) -> list[tuple[str, int, int, int, tuple[int, int]]]:
    """(path, rows, rows outside the topology, rows ending before they start, (first, last) step of
    those) of every segment with one of them or a mistyped column."""
    timed = "start_ns" in schema.names and "end_ns" in schema.names
    backwards = 'TRY_CAST(end_ns AS BIGINT) < TRY_CAST(start_ns AS BIGINT)' if timed else "false"
    outside = "NOT coalesce(list_contains($ranks, TRY_CAST(rank AS INTEGER)), false)"
    step = "TRY_CAST(step AS BIGINT)" if "step" in schema.names else "NULL::BIGINT"
    bad = f"{outside} OR {backwards}"
    rows = con.execute(
        f"SELECT filename, count(*), count(*) FILTER ({outside}), count(*) FILTER ({backwards}), "
        f"min({step}) FILTER ({bad}), max({step}) FILTER ({bad}) "
        "FROM read_parquet($files, filename=true, union_by_name=true, hive_partitioning=false) "
        f"GROUP BY filename HAVING count(*) FILTER ({bad}) > 0 OR list_contains($mistyped, filename)",
        {"files": paths, "ranks": ranks, "mistyped": list(mistyped)}).fetchall()
    return [(path, n, out, back, (lo if lo is not None else -1, hi if hi is not None else -1))
            for path, n, out, back, lo, hi in rows]


def _write_copy(con: Any, path: str, schema: pa.Schema, ranks: list[int], mistyped: dict[str, str],
                dest: Path) -> str:
    """The segment's rows that agree with the run, its columns cast to the schema's types, at `dest`."""
    columns = ", ".join(f'TRY_CAST("{f.name}" AS {_SQL_TYPE[f.type]}) AS "{f.name}"' if f.name in mistyped
                        else f'"{f.name}"' for f in schema)
    keep = "coalesce(list_contains($ranks, TRY_CAST(rank AS INTEGER)), false)"
    if "start_ns" in schema.names and "end_ns" in schema.names:
        keep += " AND NOT coalesce(TRY_CAST(end_ns AS BIGINT) < TRY_CAST(start_ns AS BIGINT), false)"
    rows = con.sql(f"SELECT {columns} FROM read_parquet($file, hive_partitioning=false) WHERE {keep}",
                   params={"file": path, "ranks": ranks}).to_arrow_table()
    dest.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows.cast(schema), dest)
    return str(dest)


def _folder_rank(path: str) -> int:
    name = os.path.basename(os.path.dirname(path))
    digits = name.partition("=")[2]
    return int(digits) if digits.isdigit() else -1
