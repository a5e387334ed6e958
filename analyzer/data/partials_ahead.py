"""The numpy collective partials of the edge event pass's batches (edge_partials.partials_of_files)
computed ahead in worker processes, while the pass takes each batch's table in order.

Why: partials_of_files runs on one Python thread (its `np.*.at` reductions hold the GIL; its reading
threads overlap only the decoding), so at 12,288 ranks x 1,000 steps its 12 batches were ~28 s of the
~47 s pass on one core of two, and would be the same on a 16-core machine. Batches are independent and a
worker computes the same table from the same files as this process would, so the pass's results do not
change. Threads were tried and did not pay (docs/measurements.md: the GIL); processes do.

Each worker writes its batch's table as an Arrow IPC file into `folder` (the store's temporary folder)
and returns the path; the table is memory-mapped here and the file unlinked at once (the mapping keeps
it until the table is dropped), so nothing crosses a pipe (~170 MB a batch) and nothing is left behind.
At most `workers + 1` batches are ahead of the one taken (their files wait in the page cache).

Whatever goes wrong in a worker (a pool that cannot start, a crash, a file it cannot write) costs
only speed: that batch, and every later one, is computed in this process as before."""

from __future__ import annotations

import enum
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import pyarrow as pa

from megascope.analyzer.data.edge_partials import partials_of_files, release_unused

PartialsArgs = tuple[int, int, int, int, Sequence[int] | None]
"""partials_of_files' arguments after the files: base, dp, tp, cp, renumber."""


class _Here(enum.Enum):
    """A batch to compute in this process (no worker's result for it)."""
    HERE = 0


_HERE = _Here.HERE


class PartialsAhead:
    """partials_of_files of each of `jobs` (one batch's edge_collectives files each, in the order the
    pass takes them), computed by `workers` processes ahead of `partials`."""

    def __init__(self, jobs: list[list[str]], args: PartialsArgs, folder: Path, workers: int) -> None:
        self.jobs, self.args, self.folder = jobs, args, folder
        self._next = 0
        """The first job not yet submitted."""
        self._ahead: dict[tuple[str, ...], Future[str | None]] = {}
        self._depth = workers + 1
        try:
            # spawn: this process has DuckDB's threads running; a forked child could inherit a held lock
            self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"))
        except (OSError, ValueError):
            self._pool = None
        self._fill()

    def _fill(self) -> None:
        while self._pool is not None and self._next < len(self.jobs) and len(self._ahead) < self._depth:
            files = self.jobs[self._next]
            path = str(self.folder / f"partials-{os.getpid()}-{self._next}.arrow")
            try:
                self._ahead[tuple(files)] = self._pool.submit(_write_partials, files, self.args, path)
            except RuntimeError:  # the pool broke (a worker died): the rest here
                self._stop()
                return
            self._next += 1

    def partials(self, files: list[str]) -> pa.Table | None:
        """partials_of_files(files, *args): a worker's, when one was computed for exactly these files
        (not after a damaged segment changed the batch), else computed here."""
        future = self._ahead.pop(tuple(files), None)
        path = self._path(future) if future is not None else _HERE
        self._fill()
        if path is _HERE:
            return partials_of_files(files, *self.args)
        if path is None:
            return None  # not for numpy (the worker's partials_of_files said so): the caller's macro
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()
        os.unlink(path)  # the mapping holds the pages until the table is dropped
        return table

    def _path(self, future: Future[str | None]) -> str | None | _Here:
        """The worker's file (None: not for numpy), or _HERE when it failed (the pool stops)."""
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - a worker's failure of any kind: this batch and the rest here
            self._stop()
            return _HERE

    def close(self) -> None:
        """Stop the workers and remove what they wrote and was not taken."""
        self._stop()

    def _stop(self) -> None:
        if self._pool is None:
            return
        for future in self._ahead.values():
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None
        for future in self._ahead.values():
            if future.done() and not future.cancelled() and future.exception() is None and future.result():
                Path(str(future.result())).unlink(missing_ok=True)
        self._ahead.clear()


def _write_partials(files: list[str], args: PartialsArgs, path: str) -> str | None:
    """In a worker: partials_of_files(files, *args) written to `path` as an Arrow IPC file; None when
    the numpy path does not apply (nothing written)."""
    table = partials_of_files(files, *args)
    if table is None:
        return None
    try:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    except BaseException:
        Path(path).unlink(missing_ok=True)  # nothing half-written left for the pass to map
        raise
    finally:
        del table
        release_unused()
    return path
