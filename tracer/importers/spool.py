"""A temporary spool of small tables: rows buffered in plain Python lists and written as Parquet parts
(`TABLE-NNNNNN.parquet`) to a temporary folder every `flush_rows` rows, so an importer reading a file of
any size holds at most `flush_rows` rows per table in memory. DuckDB reads the parts back (sorted,
joined, grouped), spilling to disk under a memory limit (`connect`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SPOOL_ROWS = 65_536
"""Rows buffered per table before a part is written: ~20 MB for the widest table (GPU activity, 8
columns) as Python tuples; all tables full at once stay under ~60 MB."""
DUCKDB_MEMORY = "512MB"
"""DuckDB's memory limit while reading a spool back; above it, sorts and joins spill to the spool folder."""


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


def connect(folder: str) -> Any:
    """A DuckDB connection bounded in memory, spilling into the spool folder."""
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET memory_limit='{DUCKDB_MEMORY}'")
    con.execute("SET temp_directory=?", [str(Path(folder) / "duckdb")])
    con.execute("SET preserve_insertion_order=false")
    return con
