"""Per-table, bounded buffers: rows in, columnar Arrow batches out.

The hot path appends one tuple (the table's columns after `rank`, in schema order) to a deque:
one atomic append under the GIL, safe against the flusher popping from the other end. The flusher
turns what is there into a columnar Arrow table (`drain`); batches that could not be written yet
stay in `backlog`, and rows beyond `capacity` (queued + backlog) are dropped and counted, so memory
stays bounded when the disk is slow or full.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np
import pyarrow as pa

log = logging.getLogger("megascope.tracer")


class TableBuffer:
    def __init__(self, name: str, schema: pa.Schema, rank: int, capacity: int, flush_rows: int) -> None:
        if schema.names[0] != "rank":
            raise ValueError(f"table {name}: first column must be 'rank', got {schema.names[0]}")
        self.name = name
        self.schema = schema
        self.rank = rank
        self.capacity = max(1, int(capacity))
        self.flush_rows = max(1, int(flush_rows))
        self.rows: deque[tuple[Any, ...]] = deque()
        self.backlog: list[pa.Table] = []
        self.backlog_rows = 0
        self.dropped = 0
        self.room = min(self.flush_rows, self.capacity)
        """Rows the hot path may queue before taking the slow path (wake the flusher or drop)."""
        self.wake: Any = None
        """Set by the flusher: called when `flush_rows` rows are queued."""

    def append(self, row: tuple[Any, ...]) -> None:
        rows = self.rows
        if len(rows) < self.room:
            rows.append(row)
        else:
            self._append_slow(row)

    def _append_slow(self, row: tuple[Any, ...]) -> None:
        if len(self.rows) + self.backlog_rows >= self.capacity:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100000 == 0:
                log.warning("tracer: %s buffer full (%d rows unwritten): dropping rows, %d so far",
                            self.name, self.capacity, self.dropped)
            return
        self.rows.append(row)
        if self.wake is not None:
            self.wake()

    def pending_rows(self) -> int:
        return len(self.rows) + self.backlog_rows

    def drain(self) -> pa.Table | None:
        """Queued rows plus the backlog as one Arrow table (None when empty); clears both."""
        count = len(self.rows)
        popleft = self.rows.popleft
        taken = [popleft() for _ in range(count)]
        parts = self.backlog
        self.backlog, self.backlog_rows = [], 0
        if taken:
            parts.append(self._to_arrow(taken))
        self._update_room()
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)

    def keep(self, batch: pa.Table) -> None:
        """Put back a batch that failed to write; the oldest rows go first when over capacity."""
        excess = batch.num_rows + len(self.rows) - self.capacity
        if excess > 0:
            self.dropped += min(excess, batch.num_rows)
            batch = batch.slice(min(excess, batch.num_rows))
        if batch.num_rows:
            self.backlog, self.backlog_rows = [batch], batch.num_rows
        self._update_room()

    def _update_room(self) -> None:
        self.room = max(0, min(self.flush_rows, self.capacity - self.backlog_rows))

    def _to_arrow(self, rows: list[tuple[Any, ...]]) -> pa.Table:
        fields = list(self.schema)
        width = len(fields) - 1
        if any(len(row) != width for row in (rows[0], rows[-1])):
            raise ValueError(f"table {self.name}: rows must have {width} values (the columns after rank)")
        # one list comprehension per column beats zip(*rows), which builds len(rows) iterators
        arrays = [pa.array(np.full(len(rows), self.rank, dtype=np.int32))]
        arrays += [pa.array([row[i] for row in rows], type=f.type) for i, f in enumerate(fields[1:])]
        return pa.Table.from_arrays(arrays, schema=self.schema)
