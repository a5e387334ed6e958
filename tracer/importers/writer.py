"""Writing an imported trace as a run directory: the same Parquet segments, run.json and in-flight
records the tracer writes, so `analyze`, `export` and `dashboard` cannot tell an import from a trace.

Rows are buffered per rank column by column (`_Columns`: numbers in typed arrays, 8 bytes a value) and
flushed through the tracer's own `ParquetSegmentSink` every `flush_rows` rows, so memory stays bounded
whatever the size of the dump.
run.json records where the data came from: `"source": "import:<format>"` and `"import"` (the source
files, their sizes, the options used, every warning and note raised while reading).

Nothing is half-written: the run is built in a hidden folder beside `out` (`.NAME.importing-*`) and
renamed to `out` once run.json is written (`finish`); a failed import removes it (`abort`), and the
folders it had to create above it, never a directory the user already had.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import uuid
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from megascope.tracer import run_dir as rd
from megascope.tracer.layout import Layout
from megascope.tracer.schema import EVENTS, KERNELS, SCHEMA_VERSION, STEPS
from megascope.tracer.sink import ParquetSegmentSink


class ImportInputError(ValueError):
    """The input cannot be imported; the message says what was expected and what to do."""


FLUSH_ROWS = 32_768
"""Rows of a rank's table buffered before a segment is written. With 131 k, a single-rank Kineto file's
import peaked 20-50 MB higher at 2 GB of JSON (137 k events) than at 0.5 GB (34 k): the buffer and its
conversion to Arrow at the flush grew until the cap (benchmarks/import_memory.py --single-gb)."""


class _Columns:
    """One table's buffered rows, column by column: integers and floats in typed arrays (8 bytes a value;
    a list of Python ints costs ~36 bytes a value, and the 131 k-row event buffer of lists added ~40 MB
    to an import's peak RSS), strings as references to the callers' str objects."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.columns: list[Any] = [array("q") if pa.types.is_integer(f.type) else
                                   array("d") if pa.types.is_floating(f.type) else [] for f in schema]

    def append(self, row: tuple) -> None:
        """One row, its values in schema order."""
        for column, value in zip(self.columns, row):
            column.append(value)

    def __len__(self) -> int:
        return len(self.columns[0])

    def table(self) -> pa.Table:
        """The rows as a table of the schema's types (numeric columns read in place, then cast)."""
        return pa.Table.from_arrays([_arrow(column, f.type) for column, f in zip(self.columns, self.schema)],
                                    schema=self.schema)


def _arrow(column: Any, dtype: pa.DataType) -> pa.Array:
    """A buffered column as an Arrow array of `dtype` (a typed array's buffer wrapped without a copy,
    then cast to the schema's width)."""
    if isinstance(column, array):
        wide = pa.int64() if column.typecode == "q" else pa.float64()
        return pa.Array.from_buffers(wide, len(column), [None, pa.py_buffer(column)]).cast(dtype)
    return pa.array(column, dtype)


class RunWriter:
    """Buffers events/steps per rank and writes them as segments of the run directory `out`."""

    def __init__(self, out: str | Path, fmt: str, flush_rows: int = FLUSH_ROWS, inputs: int = 0,
                 progress: Callable[[str, int, int], None] | None = None) -> None:
        self.final = Path(out)
        _check_out(self.final)
        self._made = _missing_parents(self.final)
        self.out = self.final.parent / f".{self.final.name}.importing-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        """Where segments are written until `finish` renames it to `final`."""
        try:
            self.out.mkdir(parents=True)
        except OSError as exc:
            self.abort()
            raise ImportInputError(f"cannot create the run beside --out {self.final}: {exc.strerror or exc}") from None
        self.fmt = fmt
        self.flush_rows = flush_rows
        self.warnings: list[str] = []
        self.notes: list[str] = []
        """How an input was read when it lacked something (no rank, no steps): not a problem, but the user
        should know what was assumed."""
        self.sources: list[dict[str, Any]] = []
        self._events: dict[int, _Columns] = {}
        self._steps: dict[int, _Columns] = {}
        self._sinks: dict[int, ParquetSegmentSink] = {}
        self.rows_written = {"events": 0, "steps": 0, "kernels": 0}
        self.inputs = inputs
        self.inputs_done = 0
        self.progress = progress or (lambda label, done, total: None)

    # ---- rows -------------------------------------------------------------------------------
    def event(self, rank: int, step: int, name: str, kind: str, start_ns: int, end_ns: int,
              issue_ns: int | None = None, microbatch: int = -1, chunk: int = -1, group: str = "",
              seq: int = -1, peer: int = -1, nbytes: int = 0) -> None:
        rows = self._events.get(rank)
        if rows is None:
            rows = self._events[rank] = _Columns(EVENTS)
        rows.append((rank, step, microbatch, chunk, name, kind, group, seq, peer, nbytes,
                     start_ns if issue_ns is None else issue_ns, start_ns, max(end_ns, start_ns)))
        if len(rows) >= self.flush_rows:
            self._flush(rank, "events")

    def step(self, rank: int, step: int, start_ns: int, end_ns: int, tokens: int = 0,
             loss: float = math.nan, lr: float = math.nan, grad_norm: float = math.nan,
             model_flops: float = 0.0) -> None:
        rows = self._steps.get(rank)
        if rows is None:
            rows = self._steps[rank] = _Columns(STEPS)
        rows.append((rank, step, start_ns, end_ns, tokens, loss, lr, grad_norm, model_flops, 0))
        if len(rows) >= self.flush_rows:
            self._flush(rank, "steps")

    def table(self, rank: int, table: str, batch: pa.Table) -> None:
        """Write an already columnar batch (vectorized importers) as one segment of `rank`."""
        schema = EVENTS if table == "events" else STEPS
        batch = batch.select([f.name for f in schema]).cast(schema)
        sink = self._sinks.get(rank)
        if sink is None:
            sink = self._sinks[rank] = ParquetSegmentSink(self.out, rank)
        sink.write(table, batch)
        self.rows_written[table] += batch.num_rows

    def kernels(self, rank: int, batch: pa.Table) -> None:
        """One kernels segment of `rank`: the schema's columns (cast to their types) first, then any
        extra columns the importer adds (the analyzer's view reads the schema's only)."""
        missing = [f.name for f in KERNELS if f.name not in batch.column_names]
        if missing:
            raise ValueError(f"kernels batch lacks column(s) {', '.join(missing)}")
        names = [f.name for f in KERNELS] + [c for c in batch.column_names if KERNELS.get_field_index(c) < 0]
        batch = batch.select(names)
        for i, f in enumerate(KERNELS):
            batch = batch.set_column(i, f, batch.column(i).cast(f.type))
        sink = self._sinks.get(rank)
        if sink is None:
            sink = self._sinks[rank] = ParquetSegmentSink(self.out, rank)
        sink.write("kernels", batch)
        self.rows_written["kernels"] += batch.num_rows

    def steps_from_events(self, rank: int, bounds: dict[int, list[int]]) -> None:
        """A steps row per step from the [first start, last end] of its events (formats without one)."""
        for step in sorted(bounds):
            if step >= 0:
                self.step(rank, step, bounds[step][0], bounds[step][1])

    def inflight(self, rank: int, record: dict[str, Any]) -> None:
        """RUN/inflight/rank=NNNNN.json, the hang watchdog's record (see docs/schema.md)."""
        rd.write_json_atomic(rd.inflight_dir(self.out) / f"rank={rank:05d}.json",
                             {"schema_version": SCHEMA_VERSION, "rank": rank, **record})

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def note(self, message: str) -> None:
        self.notes.append(message)

    def add_source(self, path: str | Path, **info: Any) -> None:
        """Record an input that was read (run.json's import.sources); counts towards the progress."""
        p = Path(path)
        self.sources.append({"path": str(p.resolve()), "bytes": p.stat().st_size if p.exists() else None, **info})
        self.input_done()

    def input_done(self) -> None:
        """One more input handled (read or skipped): moves the progress bar."""
        self.inputs_done += 1
        self.progress("reading", self.inputs_done, max(self.inputs, self.inputs_done))

    # ---- flushing ---------------------------------------------------------------------------
    def _flush(self, rank: int, table: str) -> None:
        buffers = self._events if table == "events" else self._steps
        rows = buffers.get(rank)
        if not rows:
            return
        batch = rows.table()
        sink = self._sinks.get(rank)
        if sink is None:
            sink = self._sinks[rank] = ParquetSegmentSink(self.out, rank)
        sink.write(table, batch)
        self.rows_written[table] += batch.num_rows
        buffers[rank] = _Columns(rows.schema)

    def flush_rank(self, rank: int) -> None:
        self._flush(rank, "events")
        self._flush(rank, "steps")

    def drop_rank(self, rank: int) -> None:
        """Forget a rank's buffered and written rows (its input turned out unreadable)."""
        self._events.pop(rank, None)
        self._steps.pop(rank, None)
        self._sinks.pop(rank, None)
        for table in ("events", "steps", "kernels"):
            folder = rd.table_dir(self.out, table, rank)
            if folder.is_dir():
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()

    def ranks_written(self) -> list[int]:
        return sorted(set(self._events) | set(self._steps) | set(self._sinks))

    def finish(self, layout: Layout, ranks: list[int], options: dict[str, Any],
               hosts: dict[int, str] | None = None, extra: dict[str, Any] | None = None) -> Path:
        """Flush every rank, write run.json (last: a reader never sees a manifest without data) and move
        the run into place at `final`; returns it."""
        self.progress("writing", 0, 1)
        for rank in list(set(self._events) | set(self._steps)):
            self.flush_rank(rank)
        rd.write_manifest(self.out, {
            "run_id": f"import-{self.fmt}-{int(time.time())}",
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "source": f"import:{self.fmt}",
            "import": {"format": self.fmt, "sources": self.sources, "options": options,
                       "warnings": self.warnings, "notes": self.notes, "imported_at_pid": os.getpid(),
                       "rows": dict(self.rows_written)},
            "config": {"parallel": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp}},
            "topology": layout.topology(ranks, hosts),
            "model": {},
            "schedule": "interleaved" if layout.vpp > 1 else ("1f1b" if layout.pp > 1 else "none"),
            "peak_flops": {"per_device": None, "source": f"unknown (imported from {self.fmt})"},
            "clock_offsets_ns": {str(r): 0 for r in ranks},
            "versions": {"megascope": _version()},
            **(extra or {}),
        })
        _check_out(self.final)  # another process may have written there meanwhile: never clobber it
        os.replace(self.out, self.final)  # onto a missing or empty directory: atomic
        self.out = self.final
        self.progress("writing", 1, 1)
        return self.final

    def abort(self) -> None:
        """Remove everything this import wrote (the hidden folder and the parents it created)."""
        if self.out != self.final and self.out.exists():
            shutil.rmtree(self.out, ignore_errors=True)
        for folder in self._made:  # deepest first; only if still empty (never another's files)
            try:
                folder.rmdir()
            except OSError:
                break


def _check_out(out: Path) -> None:
    """--out must be a new directory or an empty one: an import writes a whole run."""
    if (out / rd.MANIFEST).exists():
        raise ImportInputError(f"{out} already holds a run (run.json); pass a new --out directory")
    if out.exists() and not out.is_dir():
        raise ImportInputError(f"--out {out} is a file; pass a new directory for the run")
    if out.is_dir() and any(out.iterdir()):
        raise ImportInputError(f"--out {out} exists and is not empty; pass a new or empty directory "
                               "(an import writes a whole run and must not mix with other files)")


def _missing_parents(out: Path) -> list[Path]:
    """The folders above `out` that do not exist yet, deepest first."""
    missing = []
    parent = out.absolute().parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    return missing


def _version() -> str:
    from megascope import __version__

    return __version__
