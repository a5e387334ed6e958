"""The summary line in the job's own log: every `trace.summary_every` steps rank 0 prints one line with
the rolling step time (min / median / max over those steps) and the slowest ranks, chronic apart from
one-off stalls, and sends the same line to the standard `logging` logger `megascope` (INFO):

    [megascope] steps 100-149 | step time (s) min 0.412 median 0.431 max 1.902 | chronic: rank 5
    straggler severity 1.30 since step 108 | one-off: step 131 1.902 s (4.4x median) | 1 finding open

Chronic: the findings a live watcher (`megascope watch RUN`, `megascope train --watch`) has announced
and not ended, read from RUN/findings.jsonl (only the bytes appended since the last line), the most
severe first: the detectors' verdicts, which already passed their persistence and chance tests.
One-off: steps of the window that took more than STALL_RATIO x its median (the job stalled once; the
detectors do not flag a single step), and findings that ended within the window. Without a watcher the
line says so and still gives the step times and the one-off stalls.

Cheap and harmless by construction: the training thread appends one number per step and, every
`summary_every` steps, hands a copy of the window to a daemon thread (a queue of QUEUED: lines due
while that many wait behind the one being built are skipped and counted); that thread reads the
records file and builds the line, and the training thread writes it at its next step, in one write
(written from another thread, print's text and newline were two writes, and the job's own step
lines landed between them: the line was glued to the next one in 2 of 3 test runs). Any failure is
logged (the first three, then every 100th) and counted in `failures`; training never waits for the
records file.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import statistics
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megascope.tracer.run_dir import FINDINGS_FILE
from megascope.tracer.tracker_logs import FindingNote, Tracker, Window

log = logging.getLogger("megascope")
STALL_RATIO = 2.0
"""A step over this multiple of the window's median is a one-off stall: the job stood still for as long
as a whole step. Measured on clean runs on this shared 2-core machine (rank 0's steps, 10-step windows):
samples/ddp_loop.py (100 steps of ~25 ms) max/median 1.13-1.84, samples/lightning_loop.py 1.23-1.6;
the tiny preset of `megascope train` (~80 ms steps) 1.22-5.16, its 0.2-0.4 s steps being other
processes on the box taking the CPU from the job: real stalls of the job, which the line names."""
SHOWN = 3
"""At most this many chronic ranks and one-off stalls are named (the line stays one line)."""
QUEUED = 4
"""Windows that may wait for the line thread. One was too few: at load 14 on this 2-core box the thread
did not run within the 5 steps (~0.4 s) between two lines and `megascope train` lost one of 8 lines."""


@dataclass
class Verdict:
    """One finding the watcher announced, as the line needs it."""

    kind: str
    ranks: list[int]
    steps: tuple[int, int]
    severity: float
    open: bool
    evidence: dict = field(default_factory=dict)
    """the record's evidence (cause and cost, when the watcher's finding says them: tracker_logs.py)"""

    def named(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else "ranks " + ",".join(map(str, self.ranks))
        return f"{who} {self.kind} severity {self.severity:.2f}"


class LiveVerdicts:
    """RUN/findings.jsonl folded into the latest state of each finding (kind and ranks), read
    incrementally: each refresh reads only what was appended since the last one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.by_key: dict[tuple[str, tuple[int, ...]], Verdict] = {}

    def refresh(self) -> bool:
        """Read what is new; False when the file does not exist (no watcher has written it)."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return False
        if size < self.offset:  # replaced by a new watcher's file: read it from the start
            self.offset, self.by_key = 0, {}
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        whole = data.rfind(b"\n") + 1  # a line still being appended is read next time
        self.offset += whole
        for line in data[:whole].splitlines():
            self._fold(line)
        return True

    def _fold(self, line: bytes) -> None:
        try:
            r = json.loads(line)
            event, kind, ranks = r["event"], str(r["kind"]), sorted(int(x) for x in r["ranks"])
            steps, severity = (int(r["steps"][0]), int(r["steps"][1])), float(r["severity"])
            evidence = r.get("evidence") if isinstance(r.get("evidence"), dict) else {}
        except (ValueError, KeyError, TypeError, IndexError):
            return  # not a record (a foreign line): the others still count
        if event in ("start", "end"):  # 'final' is the finished run's verdict: the job is over
            self.by_key[(kind, tuple(ranks))] = Verdict(kind, ranks, steps, severity, event == "start", evidence)

    def open(self) -> list[Verdict]:
        return sorted((v for v in self.by_key.values() if v.open), key=lambda v: -v.severity)

    def ended_within(self, first: int, last: int) -> list[Verdict]:
        return [v for v in self.by_key.values() if not v.open and v.steps[1] >= first and v.steps[0] <= last]


def summary_line(window: list[tuple[int, float]], verdicts: LiveVerdicts | None) -> str:
    """The line for `window` ((step, seconds) oldest first) and the watcher's verdicts (None: no watcher)."""
    first, last = window[0][0], window[-1][0]
    times = [s for _, s in window]
    median = statistics.median(times)
    parts = [f"[megascope] steps {first}-{last}",
             f"step time (s) min {min(times):.3f} median {median:.3f} max {max(times):.3f}"]
    if verdicts is None:
        parts.append("chronic: no live verdicts (start `megascope watch RUN` for them)")
        chronic: list[Verdict] = []
        ended: list[Verdict] = []
    else:
        chronic, ended = verdicts.open(), verdicts.ended_within(first, last)
        shown = [f"{v.named()} since step {v.steps[0]}" for v in chronic[:SHOWN]]
        parts.append("chronic: " + ("; ".join(shown) if shown else "none"))
    stalls = sorted(((s, step) for step, s in window if median > 0 and s > STALL_RATIO * median), reverse=True)
    one_off = [f"step {step} {s:.3f} s ({s / median:.1f}x median)" for s, step in stalls[:SHOWN]]
    if len(stalls) > SHOWN:
        one_off.append(f"{len(stalls) - SHOWN} more steps over {STALL_RATIO:g}x")
    one_off += [f"{v.named()} steps {v.steps[0]}-{v.steps[1]} (ended)" for v in ended[:SHOWN]]
    parts.append("one-off: " + ("; ".join(one_off) if one_off else "none"))
    if verdicts is not None:
        parts.append(f"{len(chronic)} finding{'' if len(chronic) == 1 else 's'} open")
    return " | ".join(parts)


def emit(line: str) -> None:
    """The job's log: stdout (what `megascope train` and torchrun show) and the `megascope` logger."""
    sys.stdout.write(line + "\n")  # one write: nothing of another print lands inside the line
    sys.stdout.flush()
    log.info(line)


class StepSummary:
    """Rank 0's summary line every `every` steps; see the module docstring."""

    def __init__(self, run_dir: str | Path | None, every: int, out: Callable[[str], None] = emit,
                 tracker: Tracker | None = None) -> None:
        self.every, self.out, self.tracker = int(every), out, tracker
        local = run_dir is not None and "://" not in str(run_dir)  # an object-store run: no records file here
        self.verdicts = LiveVerdicts(Path(run_dir) / FINDINGS_FILE) if local else None  # type: ignore[arg-type]
        self.window: list[tuple[int, float]] = []
        self.flops: list[float] = []
        """The window's steps' model FLOPs (the tracker's MFU), beside `window`."""
        self._was_open: set[tuple[str, tuple[int, ...]]] = set()
        self.lines = 0
        """Lines written."""
        self.skipped = 0
        """Lines not written because QUEUED others were still waiting to be."""
        self.failures = 0
        """Lines that failed (logged); training went on."""
        self._queue: queue.Queue[tuple[list[tuple[int, float]], list[float]] | None] = queue.Queue(maxsize=QUEUED)
        self._thread: threading.Thread | None = None
        self._ready: deque[str] = deque()
        """Lines built, for the training thread to write at its next step."""

    def step(self, step: int, seconds: float, model_flops: float = 0.0) -> None:
        """Training thread, once per step: O(1) except every `every` steps (a copy of `every` pairs)."""
        self._write_ready()
        try:
            self.window.append((int(step), float(seconds)))
            self.flops.append(float(model_flops))
            if len(self.window) < self.every:
                return
            window, flops, self.window, self.flops = self.window, self.flops, [], []
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="megascope-summary", daemon=True)
                self._thread.start()
            self._queue.put_nowait((window, flops))
        except queue.Full:
            self.skipped += 1
        except Exception as exc:
            self._failed(exc)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            window, flops = item
            try:
                have = self.verdicts is not None and self.verdicts.refresh()
                self._ready.append(summary_line(window, self.verdicts if have else None))
                if self.tracker is not None:
                    self.tracker.window(self._tracked(window, flops, self.verdicts if have else None))
            except Exception as exc:
                self._failed(exc)

    def _tracked(self, window: list[tuple[int, float]], flops: list[float], verdicts: LiveVerdicts | None) -> Window:
        """The window as the tracker takes it: the findings open now, opened since the last window, ended."""
        first, last = window[0][0], window[-1][0]
        now = verdicts.open() if verdicts is not None else []
        ended = verdicts.ended_within(first, last) if verdicts is not None else []
        opened = [v for v in now if (v.kind, tuple(v.ranks)) not in self._was_open]
        self._was_open = {(v.kind, tuple(v.ranks)) for v in now}
        return Window(first, last, [s for _, s in window], flops, [_note(v) for v in now],
                      [_note(v) for v in opened], [_note(v) for v in ended])

    def _write_ready(self) -> None:
        while self._ready:
            try:
                self.out(self._ready.popleft())
                self.lines += 1
            except Exception as exc:
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        if self.failures <= 3 or self.failures % 100 == 0:
            log.warning("summary line failed (%r); %d failures so far, training continues", exc, self.failures)

    def close(self, timeout_s: float = 2.0) -> None:
        """Let the lines being built finish (at most timeout_s), write them, stop the thread, close the
        tracker (unless the thread is stuck in it: then the daemon thread dies with the process)."""
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=timeout_s)
                self._thread.join(timeout_s)
            except queue.Full:
                pass  # stuck reading the records file: the daemon thread dies with the process
            self._write_ready()
        if self.tracker is not None and not (self._thread is not None and self._thread.is_alive()):
            try:
                self.tracker.close()
            except Exception as exc:
                self._failed(exc)


def _note(v: Verdict) -> FindingNote:
    return FindingNote(v.kind, v.ranks, v.steps, v.evidence)
