"""A temporary spool of small tables: rows buffered in plain Python lists and written as Parquet parts
(`TABLE-NNNNNN.parquet`) to a temporary folder every `flush_rows` rows, so an importer reading a file of
any size holds at most `flush_rows` rows per table in memory. DuckDB reads the parts back (sorted,
joined, grouped), spilling to disk under a memory limit (`connect`); a table read back in time order
is sorted one window of start times at a time (`sorted_batches`)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SPOOL_ROWS = 16_384
"""Rows buffered per table before a part is written: ~5 MB for the widest table (GPU activity, 8
columns) as Python tuples; all tables full at once stay under ~15 MB. (At 64 k rows the buffers were
still filling at 1 GB of JSON: reading's peak RSS rose 181 -> 195 -> 204 MB at 0.5, 1, 2 GB.)"""
DUCKDB_MEMORY = "512MB"
"""DuckDB's memory limit while reading a spool back; above it, sorts and joins spill to the spool folder."""
SORT_WINDOW_ROWS = 16_384
"""Rows DuckDB sorts at once in `sorted_batches`. A sort holds all its input below the memory limit, so
one ORDER BY over a file's comm table grew with the file: +18 MB of RSS at 0.5 GB of JSON (50 k rows),
+68 MB at 2 GB (200 k rows); in windows of 16 k rows +20 and +29 MB (64 k: +35 MB at 2 GB)."""


class Spool:
    """Rows of the tables `schemas` (name -> schema), appended as tuples in schema order."""

    def __init__(self, schemas: dict[str, pa.Schema], prefix: str, flush_rows: int | None = None) -> None:
        self.schemas = schemas
        self.prefix = prefix
        self.flush_rows = flush_rows or SPOOL_ROWS
        self.folder: str | None = None
        self.rows = dict.fromkeys(schemas, 0)
        """Rows appended per table (spooled or buffered)."""
        self._buffers: dict[str, list[tuple]] = {name: [] for name in schemas}
        self._parts = 0

    def append(self, table: str, row: tuple) -> None:
        buffer = self._buffers[table]
        buffer.append(row)
        self.rows[table] += 1
        if len(buffer) >= self.flush_rows:
            self._flush(table)

    def _flush(self, table: str) -> None:
        buffer = self._buffers[table]
        if not buffer:
            return
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix=self.prefix)
        schema = self.schemas[table]
        columns = list(zip(*buffer))
        batch = pa.Table.from_arrays([pa.array(col, f.type) for col, f in zip(columns, schema)], schema=schema)
        pq.write_table(batch, Path(self.folder) / f"{table}-{self._parts:06d}.parquet", compression="zstd")
        self._parts += 1
        buffer.clear()

    def close(self) -> str | None:
        """Write what is buffered; the folder (None: nothing was appended)."""
        for table in self.schemas:
            self._flush(table)
        return self.folder

    def discard(self) -> None:
        remove(self.folder)
        self.folder = None


def remove(folder: str | None) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def parts(folder: str, table: str) -> str | None:
    """A read_parquet() argument for `table`'s parts (None: the table got no rows)."""
    return f"{folder}/{table}-*.parquet" if any(Path(folder).glob(f"{table}-*.parquet")) else None


def sorted_batches(con: Any, columns: str, source: str, where: str, order: str, params: dict[str, Any],
                   batch_rows: int = 8_192, window_rows: int | None = None) -> Iterator[Any]:
    """`SELECT columns FROM source WHERE where ORDER BY order` as Arrow record batches, `order` starting
    with the `start` column. Sorted window by window: cut at approximate quantiles of `start` into
    windows of about `window_rows` rows (a cut is a value of start, so ties stay in one window), each
    window selected and sorted on its own, so memory does not grow with the table (window_rows: None
    for SORT_WINDOW_ROWS)."""
    window_rows = window_rows or SORT_WINDOW_ROWS
    [(rows,)] = con.execute(f"SELECT count(*) FROM {source} WHERE {where}", params).fetchall()
    cuts: list[int] = []
    if rows > window_rows:
        windows = -(-rows // window_rows)
        at = [i / windows for i in range(1, windows)]
        [(found,)] = con.execute(f"SELECT approx_quantile(start, $at::FLOAT[]) FROM {source} WHERE {where}",
                                 {**params, "at": at}).fetchall()
        cuts = sorted(set(found))
    bounds: list[int | None] = [None, *cuts, None]
    for lo, hi in zip(bounds, bounds[1:]):
        window = ([] if lo is None else ["start >= $lo"]) + ([] if hi is None else ["start < $hi"])
        query = f"SELECT {columns} FROM {source} WHERE ({where}){''.join(' AND ' + w for w in window)} ORDER BY {order}"
        bound = {**params, **({} if lo is None else {"lo": lo}), **({} if hi is None else {"hi": hi})}
        yield from con.sql(query, params=bound).to_arrow_reader(batch_rows)


def connect(folder: str) -> Any:
    """A DuckDB connection bounded in memory, spilling into the spool folder."""
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET memory_limit='{DUCKDB_MEMORY}'")
    con.execute("SET temp_directory=?", [str(Path(folder) / "duckdb")])
    con.execute("SET preserve_insertion_order=false")
    return con
