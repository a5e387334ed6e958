"""Where the watcher's records go: stdout, RUN/findings.jsonl, a webhook, a command.

A record is one finding as `analyze --json` writes it (kind, ranks, hosts, steps, severity, summary,
evidence) plus `event` ('start', 'end', 'open_at_end' or 'final'), `at_step` and `time` (UTC, ms). The
webhook and the command
run on background threads behind bounded queues, so a dead endpoint or a slow command never holds
the watcher back; what they could not deliver is counted and logged, never raised.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

Record = dict[str, Any]
Log = Callable[[str], None]


def line_of(record: Record) -> str:
    """One line for a person: what changed, where, and the finding's own sentence."""
    steps = record["steps"]
    verb = {"start": "NEW", "update": "MORE", "end": "ENDED", "open_at_end": "OPEN AT END",
            "final": "FINAL"}.get(record["event"], record["event"])
    return f"[step {record['at_step']}] {verb} {record['kind']} (steps {steps[0]}-{steps[1]}): {record['summary']}"


class StdoutSink:
    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    def send(self, record: Record) -> None:
        print(line_of(record), file=self.out, flush=True)

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per line; each line is written whole and flushed (a reader tailing the
    file sees complete lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def send(self, record: Record) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, allow_nan=False, default=str) + "\n")

    def close(self) -> None:
        pass


class BackgroundSink:
    """Delivers records on its own thread, in order, each retried with exponential backoff.

    `deliver(record)` raises on failure. The queue is bounded: when full the oldest record is dropped
    (counted): a watcher of a long job must not grow without bound behind a dead endpoint."""

    def __init__(self, name: str, deliver: Callable[[Record], None], log: Log, tries: int = 5,
                 first_delay_s: float = 0.5, max_queue: int = 1000) -> None:
        self.name, self.deliver, self.log = name, deliver, log
        self.tries, self.first_delay_s = tries, first_delay_s
        self.queue: queue.Queue[Record | None] = queue.Queue(max_queue)
        self.delivered = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"megascope-watch-{name}", daemon=True)
        self._thread.start()

    def send(self, record: Record) -> None:
        while True:
            try:
                self.queue.put_nowait(record)
                return
            except queue.Full:
                try:
                    self.queue.get_nowait()
                    self.failed += 1
                    self.log(f"{self.name}: queue full, dropped the oldest record")
                except queue.Empty:
                    pass

    def _loop(self) -> None:
        while (record := self.queue.get()) is not None:
            delay = self.first_delay_s
            for attempt in range(1, self.tries + 1):
                try:
                    self.deliver(record)
                    self.delivered += 1
                    break
                except Exception as exc:  # any failure of the endpoint: retried, then counted
                    if attempt == self.tries or self._stop.wait(delay):
                        self.failed += 1
                        self.log(f"{self.name}: gave up on a record after {attempt} tries ({exc})")
                        break
                    delay *= 2

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued within `timeout_s`, then stop (waiting retries are cut short)."""
        self.queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(1.0)
            left = self.queue.qsize()
            if left:
                self.log(f"{self.name}: {left} record(s) not delivered at exit")


def post_json(url: str, timeout_s: float = 3.0) -> Callable[[Record], None]:
    """deliver() for a webhook: POST the record as a JSON body; a non-2xx answer is a failure."""
    def deliver(record: Record) -> None:
        body = json.dumps(record, allow_nan=False, default=str).encode()
        req = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "megascope-watch"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            if not 200 <= resp.status < 300:
                raise urllib.error.HTTPError(url, resp.status, "not 2xx", resp.headers, None)
    return deliver


def run_command(command: str, timeout_s: float = 60.0) -> Callable[[Record], None]:
    """deliver() for --on-finding: run the command (no shell) with the record as JSON on stdin and
    MEGASCOPE_EVENT / MEGASCOPE_KIND / MEGASCOPE_SUMMARY in its environment; non-zero exit fails."""
    argv = shlex.split(command)

    def deliver(record: Record) -> None:
        env = dict(os.environ, MEGASCOPE_EVENT=str(record["event"]), MEGASCOPE_KIND=str(record["kind"]),
                   MEGASCOPE_SUMMARY=str(record["summary"]))
        done = subprocess.run(argv, check=False, input=json.dumps(record, default=str), text=True, env=env,
                              capture_output=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[:200]}")
    return deliver


def now_iso() -> str:
    """UTC with milliseconds: records of one tick are apart by less than a second."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
