"""The background thread that moves buffered rows into the sink.

It wakes every `interval_s`, or early when a buffer has `flush_rows` rows queued, drains each table
into one Arrow batch and hands it to the sink. A failing write (disk full, permission denied) is
counted and logged (first occurrence, then every 100th), the batch is kept for the next try within the
buffer's memory bound, and the thread goes on: monitoring must never crash or stall training.
"""

from __future__ import annotations

import logging
import threading

import pyarrow as pa

from megascope.tracer.buffer import TableBuffer
from megascope.tracer.sink import Sink

log = logging.getLogger("megascope.tracer")


class Flusher:
    def __init__(self, buffers: dict[str, TableBuffer], sink: Sink, interval_s: float,
                 thread_name: str = "megascope-flusher") -> None:
        self.buffers = buffers
        self.sink = sink
        self.interval_s = max(0.01, float(interval_s))
        self.write_errors = 0
        self.flushes = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        for buffer in buffers.values():
            buffer.wake = self._wake.set
        # pyarrow imports pandas on its first conversion (~0.2-0.4 s holding the GIL): pay it here, at
        # start, rather than in the first flush, where it would stall a training step
        pa.array([0], type=pa.int64())
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self._stopping:
                self.flush()

    def flush(self) -> None:
        """Drain every table into the sink now (also called by close and by tests)."""
        with self._lock:
            for name, buffer in self.buffers.items():
                self._flush_one(name, buffer)
            self.flushes += 1

    def _flush_one(self, name: str, buffer: TableBuffer) -> None:
        try:
            batch = buffer.drain()
        except Exception as exc:  # a malformed row: drop this drain, keep tracing
            self._count_error(f"could not build the {name} batch: {exc!r}")
            return
        if batch is None:
            return
        try:
            self.sink.write(name, batch)
        except Exception as exc:
            self._count_error(f"writing the {name} table failed: {exc!r}; "
                              f"{batch.num_rows} rows kept for the next flush")
            buffer.keep(batch)

    def _count_error(self, message: str) -> None:
        self.write_errors += 1
        if self.write_errors == 1 or self.write_errors % 100 == 0:
            log.warning("tracer: %s (%d write errors so far; training continues)", message, self.write_errors)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and flush what is left; the sink is closed by the owner."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        self.flush()
