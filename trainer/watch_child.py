"""`megascope train --watch`: `megascope watch RUN` as a child process beside the job.

The watcher is a separate process (`python -m megascope watch RUN ARGS`), not a thread: the trainer
never imports the analyzer (DuckDB), and whatever the watcher does (a crash, a full disk, a slow final
analysis) cannot touch the ranks. A watcher that exits with an error while the job runs is logged in
one line, counted and started again (a restarted watcher picks up its open findings from
RUN/findings.jsonl), at most MAX_RESTARTS times; training goes on either way.

When the job ends: after a finished job the watcher sees every rank's last step and stops by itself
with the final verdict (what `megascope analyze` finds); it gets FINISH_TIMEOUT_S for that. After a
failed or interrupted job the run never finishes, so it gets SIGTERM at once: it completes its tick
and stops, leaving its findings open (a hang is not over because the job stopped). A watcher that
ignores SIGTERM for TERM_TIMEOUT_S is killed.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

MAX_RESTARTS = 3
FINISH_TIMEOUT_S = 120.0   # window tick + full analysis of the finished run; a tiny run takes seconds
TERM_TIMEOUT_S = 15.0      # one tick in progress (seconds at 8 ranks) before the watcher stops
_SIGNAL_EXITS = {128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM}


def parse_watch_args(text: str) -> list[str]:
    """--watch-args split like a shell command line; ValueError (one line) on unbalanced quotes."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"--watch-args '{text}': {exc}") from None


def _log(line: str) -> None:
    print(f"[megascope] watch: {line}", file=sys.stderr, flush=True)


class WatchChild:
    """Starts, restarts and stops the watcher of one run directory."""

    def __init__(self, run_dir: str | Path, extra_args: list[str], log: Callable[[str], None] = _log,
                 finish_timeout_s: float = FINISH_TIMEOUT_S, term_timeout_s: float = TERM_TIMEOUT_S) -> None:
        self.argv = [sys.executable, "-m", "megascope", "watch", str(run_dir), *extra_args]
        self.log, self.finish_timeout_s, self.term_timeout_s = log, finish_timeout_s, term_timeout_s
        self.proc: subprocess.Popen | None = None
        self.failures = 0
        """Watcher processes that failed to start or exited with an error while the job ran."""
        self.returncode: int | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    def start(self) -> WatchChild:
        self._spawn()
        self._monitor = threading.Thread(target=self._watch_the_watcher, name="megascope-watch-child", daemon=True)
        self._monitor.start()
        return self

    def _spawn(self) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            try:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL)
            except OSError as exc:
                self.proc = None
                self.failures += 1
                self.log(f"could not start the watcher ({exc}); the job goes on without it")

    def _watch_the_watcher(self) -> None:
        """While the job runs: a watcher that exits with an error is logged, counted and restarted."""
        while not self._stopping.wait(1.0):
            proc = self.proc
            if proc is None:
                return
            rc = proc.poll()
            if rc is None:
                continue
            if rc == 0 or rc in _SIGNAL_EXITS:  # done by itself (run finished) or stopped by Ctrl-C
                return
            self.failures += 1
            if self.failures > MAX_RESTARTS:
                self.log(f"the watcher exited with code {rc} ({self.failures} failures); not restarting it, "
                         "the job goes on")
                return
            self.log(f"the watcher exited with code {rc} (failure {self.failures} of {MAX_RESTARTS + 1}); "
                     "restarting it, the job goes on")
            self._spawn()

    def stop(self, job_finished: bool) -> int | None:
        """The job ended: let the watcher finish (job_finished) or stop it; returns its exit code
        (None when it never ran). Never raises: the job's result is what counts."""
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join(5.0)
        with self._lock:
            proc = self.proc
        if proc is None:
            return None
        try:
            if job_finished and proc.poll() is None:
                try:
                    proc.wait(self.finish_timeout_s)
                except subprocess.TimeoutExpired:
                    self.log(f"no final verdict after {self.finish_timeout_s:g} s; stopping the watcher")
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)   # the tick in progress completes, then it stops
                try:
                    proc.wait(self.term_timeout_s)
                except subprocess.TimeoutExpired:
                    self.log(f"the watcher did not stop within {self.term_timeout_s:g} s of SIGTERM; killed")
                    proc.kill()
                    proc.wait()
        except OSError as exc:
            self.log(f"stopping the watcher failed ({exc})")
        self.returncode = proc.returncode
        run = self.argv[4]
        if not job_finished:
            self.log(f"stopped without a final verdict (the job did not finish); records so far in "
                     f"{run}/findings.jsonl; the verdict: megascope analyze {run}")
        elif self.returncode != 0:
            self.log(f"the watcher exited with code {self.returncode}; the verdict: megascope analyze {run}")
        return self.returncode
