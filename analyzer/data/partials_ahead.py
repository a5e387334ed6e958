"""The numpy collective partials of the edge event pass's batches (edge_partials.partials_of_files)
computed ahead in worker processes, while the pass takes each batch's table in order.

Why: partials_of_files runs on one Python thread (its `np.*.at` reductions hold the GIL; its reading
threads overlap only the decoding), so at 12,288 ranks x 1,000 steps its 12 batches were ~28 s of the
~47 s pass on one core of two, and would be the same on a 16-core machine. Batches are independent and a
worker computes the same table from the same files as this process would, so the pass's results do not
change. Threads were tried and did not pay (docs/measurements.md: the GIL); processes do.

The workers are plain Python processes running this module's `main` (not multiprocessing's: those
import the caller's main module again, and a script that analyzes a run at import time would analyze it
once more in every worker); each peaks at ~0.65 GB (a 1,024-rank x 1,000-step batch), and `--threads`
bounds how many run. Each reads one job a line on stdin - a batch's files, the
layout, the path to write - and answers one line: the path of its batch's table, written as an Arrow
IPC file into `folder` (the store's temporary folder), or none (not for numpy). Job k goes to worker
k mod n, so each worker's answers come in the pass's order. The pass memory-maps the table and unlinks
the file at once (the mapping keeps it until the table is dropped): nothing crosses a pipe (~170 MB a
batch) and nothing is left behind. Each worker holds at most two jobs (their files wait in the page cache).

Whatever goes wrong with a worker (it cannot start, dies, cannot write its file) costs only speed: that
batch, and every later one, is computed in this process as before."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import pyarrow as pa

from megascope.analyzer.data.edge_partials import partials_of_files, release_unused

log = logging.getLogger("megascope.analyzer")

PartialsArgs = tuple[int, int, int, int, Sequence[int] | None]
"""partials_of_files' arguments after the files: base, dp, tp, cp, renumber."""
JOBS_PER_WORKER = 2
"""Jobs sent to a worker before its first answer is taken: one computing, one waiting."""


class PartialsAhead:
    """partials_of_files of each of `jobs` (one batch's edge_collectives files each, in the order the
    pass takes them), computed by `workers` processes ahead of `partials`."""

    def __init__(self, jobs: list[list[str]], args: PartialsArgs, folder: Path, workers: int) -> None:
        self.jobs, self.args, self.folder = jobs, args, folder
        self._sent: deque[tuple[tuple[str, ...], str, _Worker]] = deque()
        """(files, path, worker) of the jobs sent and not yet taken, in job order."""
        self._next = 0
        """The first job not yet sent."""
        self._workers: list[_Worker] = []
        try:
            for _ in range(workers):
                self._workers.append(_Worker())
        except OSError as exc:
            self._stop(f"a worker could not start ({exc})")
        self._send()

    def _send(self) -> None:
        while self._workers and self._next < len(self.jobs) \
                and len(self._sent) < JOBS_PER_WORKER * len(self._workers):
            files = self.jobs[self._next]
            path = str(self.folder / f"partials-{os.getpid()}-{self._next}.arrow")
            worker = self._workers[self._next % len(self._workers)]
            if not worker.send(files, self.args, path):
                self._stop(worker.failure())
                return
            self._sent.append((tuple(files), path, worker))
            self._next += 1

    def partials(self, files: list[str]) -> pa.Table | None:
        """partials_of_files(files, *args): a worker's, when one was computed for exactly these files,
        else computed here (a batch whose files changed after a damaged segment was dropped; the jobs
        before it in the queue, which the pass no longer asks for, are let go)."""
        key = tuple(files)
        if key not in [sent for sent, _, _ in self._sent]:
            return partials_of_files(files, *self.args)
        while self._sent:
            sent, path, worker = self._sent.popleft()
            answer = worker.receive()
            self._send()
            if answer is None:
                self._stop(worker.failure())
                return partials_of_files(files, *self.args)
            if sent == key:
                break
            Path(path).unlink(missing_ok=True)
        if not answer:
            return None  # not for numpy (the worker's partials_of_files said so): the caller's macro
        table = pa.ipc.open_file(pa.memory_map(path)).read_all()
        os.unlink(path)  # the mapping holds the pages until the table is dropped
        return table

    def close(self) -> None:
        """Stop the workers and remove what they wrote and was not taken."""
        self._stop()

    def _stop(self, failure: str | None = None) -> None:
        if failure and self._workers:
            log.warning("the collective partials' worker processes stopped: %s; the remaining batches "
                        "are computed in this process", failure)
        for worker in self._workers:
            worker.stop()
        self._workers = []
        for _, path, _ in self._sent:
            Path(path).unlink(missing_ok=True)
        self._sent.clear()


class _Worker:
    """One worker process and its two pipes (its stderr is dropped: a failure is told by `failure`)."""

    def __init__(self) -> None:
        # -c, not -m: the package imports this module first, and runpy would then run a second copy
        self.proc = subprocess.Popen([sys.executable, "-c", f"from {__name__} import main; main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1)
        self._stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
        self._stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]
        self._error = ""

    def send(self, files: list[str], args: PartialsArgs, path: str) -> bool:
        """Send one job; False when the worker is gone."""
        try:
            self._stdin.write(json.dumps([files, list(args), path]) + "\n")
            self._stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def receive(self) -> str | None:
        """The answer to the oldest job sent: its file's path, "" (not for numpy), None (failed)."""
        try:
            line = self._stdout.readline()
            answer = json.loads(line) if line else {}
        except (OSError, ValueError):
            return None
        self._error = str(answer.get("error", ""))
        return answer.get("path")

    def failure(self) -> str:
        """What went wrong, in a few words."""
        code = self.proc.poll()
        return self._error or (f"a worker exited (code {code})" if code is not None else "a worker did not answer")

    def stop(self) -> None:
        """End of input, then wait; killed if it does not end (it may be inside a big batch)."""
        try:
            self._stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stdout.close()


def _write_partials(files: list[str], args: PartialsArgs, path: str) -> str:
    """partials_of_files(files, *args) written to `path` as an Arrow IPC file; "" when the numpy path
    does not apply (nothing written)."""
    table = partials_of_files(files, *args)
    if table is None:
        return ""
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


def main() -> None:
    """A worker: one job a line on stdin, one answer a line on stdout ({"path": ...} or {"error": ...})."""
    for line in sys.stdin:
        files, args, path = json.loads(line)
        try:
            answer = {"path": _write_partials(files, tuple(args), path)}
        except Exception as exc:  # noqa: BLE001 - any failure is the pass's to handle: it computes the batch
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
