"""`megascope watch RUN`: live diagnosis beside a running job.

Each poll lists the run's segments and in-flight records; when they changed, one tick:
1. reads how far the run got from the new steps segments only (window.ProgressFollower);
2. when the last complete step advanced, extends the persisted rank-step summary from the new steps
   only (summary_cache.py), so the dashboard's heatmap is current, and (also when hang records
   appeared) runs the default detectors over the last `window` complete steps (analyze_window);
3. compares those findings with the open ones (tracker.Tracker) and sends each start and end to
   the sinks (sinks.py: stdout, RUN/findings.jsonl, webhook, command), updates the metrics.
When the run is finished (every rank recorded run.json's last step) or has been idle for
`idle_exit_s`, the watcher runs the full analysis (what `megascope analyze` finds), announces what the
windows missed, ends what is open and writes each final finding ('final' records), then stops.
A tick that fails is logged, counted and retried with backoff; the watcher keeps going.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

from megascope.analyzer.data.store import RunOpenError, Store
from megascope.analyzer.findings import Finding
from megascope.analyzer.report.build import json_safe
from megascope.analyzer.run import Run
from megascope.analyzer.settings import WATCH_WINDOW, AnalyzerSettings
from megascope.analyzer.watch.control import ControlApp, serve
from megascope.analyzer.watch.metrics import WatchMetrics
from megascope.analyzer.watch.sinks import (
    BackgroundSink,
    JsonlSink,
    Record,
    StdoutSink,
    now_iso,
    post_json,
    run_command,
)
from megascope.analyzer.watch.tracker import Tracker, key_of
from megascope.analyzer.watch.window import Progress, ProgressFollower, SegmentSteps, analyze_full, analyze_window
from megascope.tracer import run_dir as rd

MAX_RETRY_S = 60.0
"""A tick that keeps failing is retried at most this far apart (not every poll: the log stays readable)."""


@dataclass
class WatchConfig:
    window: int = WATCH_WINDOW
    """Complete steps the detectors see per tick (settings.WATCH_WINDOW)."""
    poll_s: float = 1.0
    webhook: str | None = None
    on_finding: str | None = None
    metrics_port: int | None = None
    idle_exit_s: float | None = None
    summary: bool = True
    threads: int | None = None
    findings_file: Path | None = None
    """Default RUN/findings.jsonl."""
    settings: AnalyzerSettings = field(default_factory=AnalyzerSettings)
    """The detectors' thresholds (`--set`), as `megascope analyze` takes them."""
    bind: str = "127.0.0.1"
    """Address of the HTTP port (metrics_port): /metrics, /status, /settings (watch/control.py)."""
    token: str | None = None
    """Secret every HTTP request must send (`Authorization: Bearer ...`); required off loopback."""
    follows: str | None = None
    """What the watcher follows when it is not `run_dir` itself (an object-store URL mirrored there)."""


@dataclass
class WatchState:
    analyzed_step: int | None = None
    inflight: frozenset = frozenset()
    signature: frozenset = frozenset()
    changed_at: float = field(default_factory=time.monotonic)
    progress: Progress | None = None
    errors: int = 0
    failing: int = 0
    """Ticks failed in a row: the next try waits poll_s x 2^(failing-1), at most MAX_RETRY_S."""
    retry_at: float = 0.0
    ticks: int = 0
    last_tick_at: float | None = None
    lag_s: float | None = None
    """From the newest segment of the last tick landing to that tick done."""
    pending_since: float | None = None
    """When the polls first saw segments or in-flight records that no tick has taken in yet."""
    pending: int = 0
    """Segments (and in-flight changes) seen at the last poll and not yet taken in."""


class Watcher:
    def __init__(self, run_dir: str | Path, cfg: WatchConfig | None = None,
                 out=None, log: Callable[[str], None] | None = None) -> None:
        self.path = Path(run_dir)
        self.cfg = cfg or WatchConfig()
        self.log = log or (lambda msg: print(f"megascope watch: {msg}", file=sys.stderr, flush=True))
        self.tracker = Tracker(end_after=self.cfg.settings.detect.straggler.max_gap + 1)
        self.state = WatchState()
        self.metrics: WatchMetrics | None = None
        self.follower: ProgressFollower | None = None
        self.segment_steps = SegmentSteps()
        self.server: WSGIServer | None = None  # /metrics, when metrics_port is set
        self.sinks: list[Any] = [StdoutSink(out), JsonlSink(self.cfg.findings_file or self.path / rd.FINDINGS_FILE)]
        if self.cfg.on_finding:
            self.sinks.append(BackgroundSink("on-finding", run_command(self.cfg.on_finding), self.log))
        self.webhook: BackgroundSink | None = None
        if self.cfg.webhook:
            self.webhook = BackgroundSink("webhook", post_json(self.cfg.webhook), self.log)
        self.started_at = time.monotonic()
        self._changing = threading.Lock()
        self.run_id = "?"
        self._waiting = False
        self._restore()
        self.records: list[Record] = []
        """Every record sent, in order (tests and the final summary read it)."""
        if self.cfg.metrics_port is not None:  # OSError when the port is taken: the CLI says so
            self.server = serve(ControlApp(self, self.cfg.token), self.cfg.bind, self.cfg.metrics_port)
            self.log(f"metrics, status and settings on http://{self.cfg.bind}:{self.server.server_port} "
                     "(/metrics, /status, /settings)")

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> int:
        """Watch until the run is over, `stop` is set, or SIGINT/SIGTERM (from the main thread): the
        tick in progress completes, then the watcher stops (a second Ctrl-C stops at once).
        0 when the run is over or `stop` was set, 128 + the signal's number after a signal."""
        stop = stop or threading.Event()
        caught: list[int] = []
        restore = self._on_signals(stop, caught)
        try:
            while not stop.is_set():
                if self.poll():
                    return self._finish_logged()
                stop.wait(self.cfg.poll_s)
            self.log(f"stopped at step {self.state.analyzed_step}; {len(self.tracker.open)} finding(s) open")
            return 128 + caught[0] if caught else 0
        except KeyboardInterrupt:
            self.log(f"interrupted at step {self.state.analyzed_step}; {len(self.tracker.open)} finding(s) open")
            return 130
        finally:
            restore()
            self.close()

    def _on_signals(self, stop: threading.Event, caught: list[int]) -> Callable[[], None]:
        """SIGINT/SIGTERM set `stop` (a DuckDB query interrupted mid-tick would otherwise be just
        another failed tick); returns what puts the old handlers back."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, _frame) -> None:
            caught.append(signum)
            stop.set()
            self.log("stopping after this tick (Ctrl-C again to stop now)")
            signal.signal(signal.SIGINT, signal.default_int_handler)

        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for sig, previous in old.items():
                signal.signal(sig, previous)
        return restore

    def poll(self) -> bool:
        """One look at the run; True when it is over (finished, or idle for idle_exit_s)."""
        if not (self.path / rd.MANIFEST).is_file():
            if not self._waiting:  # started before the job wrote run.json: wait for it
                self.log(f"waiting for {self.path / rd.MANIFEST}")
                self._waiting = True
            return False
        segments, inflight = self._listing()
        now = time.monotonic()
        changed = segments != self.state.signature or inflight != self.state.inflight
        self.state.pending = len(segments - self.state.signature) + (inflight != self.state.inflight)
        if self.state.pending and self.state.pending_since is None:
            self.state.pending_since = now
        if changed and now >= self.state.retry_at:
            new = segments - self.state.signature
            self.state.signature, self.state.changed_at = segments, now
            try:
                self.tick(inflight, new)
            except RunOpenError:
                raise
            except Exception as exc:  # a tick never kills the watcher: logged, counted, retried
                self.state.errors += 1
                self.state.failing += 1
                self.state.signature = frozenset()  # analyze again, after a backoff
                delay = min(MAX_RETRY_S, self.cfg.poll_s * 2 ** (self.state.failing - 1))
                self.state.retry_at = now + delay
                if self.metrics is not None:
                    self.metrics.errors.inc()
                self.log(f"tick failed ({type(exc).__name__}: {exc}); retrying in {delay:g} s")
                return False
            self.state.failing, self.state.pending, self.state.pending_since = 0, 0, None
        progress = self.state.progress
        if progress is not None and progress.finished:
            return True
        idle = self.cfg.idle_exit_s
        return idle is not None and progress is not None and now - self.state.changed_at >= idle

    def tick(self, inflight: frozenset, new_segments: frozenset) -> None:
        follower = self._start()
        follower.add(new_segments)
        progress = follower.progress()
        self.state.progress = progress
        m = self.metrics
        assert m is not None  # _start() has set it
        m.dropped.set(progress.dropped_events)
        m.finished.set(1 if progress.finished else 0)
        step = progress.complete_step
        if step is None or (step == self.state.analyzed_step and inflight == self.state.inflight):
            return
        if step != self.state.analyzed_step:
            m.step_advanced(step)
            if self.cfg.summary:  # the dashboard's heatmap: extended from the new steps only
                Run.open(self.path, threads=self.cfg.threads).refresh_summary()
        cfg = self.cfg  # one tick, one config: a change over HTTP takes effect from the next tick
        window = analyze_window(self.path, step - cfg.window + 1, step, cfg.threads, self.segment_steps, cfg.settings)
        self.state.analyzed_step, self.state.inflight = step, inflight
        for change in self.tracker.update(window.findings, step):
            self._send(change.event, change.finding, change.at_step)
        self._window_metrics(m, window, step)
        m.ticks.inc()
        self.state.lag_s = max(0.0, time.time() - max((_mtime(self.path / p) for p in new_segments),
                                                      default=time.time()))
        m.lag.set(self.state.lag_s)
        self.state.ticks, self.state.last_tick_at = self.state.ticks + 1, time.monotonic()

    def _finish_logged(self) -> int:
        try:
            self.finish()
            return 0
        except RunOpenError:
            raise
        except Exception as exc:  # the live records stand; only the verdict is missing
            self.log(f"the final analysis failed ({type(exc).__name__}: {exc}); "
                     f"run `megascope analyze {self.path}` for the verdict")
            return 1

    def finish(self) -> None:
        """The run is over: the full analysis's verdict (equal to `megascope analyze`). A finished run
        ends its open findings; a run that went idle (hung, or stopped short) leaves them open: a
        watcher restarted on it picks them up (findings.jsonl)."""
        step = self.state.analyzed_step if self.state.analyzed_step is not None else -1
        finished = self.state.progress is not None and self.state.progress.finished
        final = analyze_full(self.path, self.cfg.threads, self.cfg.settings)
        for f in final:
            if key_of(f) not in self.tracker.seen:  # the windows missed it (e.g. a slow trend)
                self._send("start", f, step)
                self.tracker.open[key_of(f)] = f
                self.tracker.seen.add(key_of(f))
        if finished:
            for change in self.tracker.close_all(step):
                self._send(change.event, change.finding, change.at_step)
        for f in final:
            self._send("final", f, step)
        if self.metrics is not None:
            self.metrics.open_findings(list(self.tracker.open.values()))
        how = "finished" if finished else "idle"
        self.log(f"run {how} at step {step}: {len(final)} finding(s), {len(self.tracker.open)} still open; "
                 f"records in {self.findings_path()}")

    def close(self) -> None:
        for sink in self._all_sinks():
            sink.close()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # ---- helpers --------------------------------------------------------------------------------
    def _restore(self) -> None:
        """A watcher restarted on the same run picks up the open findings from findings.jsonl, so
        it does not page again for what it already announced (each start without its end is open)."""
        try:
            lines = self.findings_path().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            return
        skipped = 0
        for line in lines:
            try:
                r = json.loads(line)
                finding = Finding(r["kind"], list(r["ranks"]), list(r["hosts"]), (int(r["steps"][0]),
                                  int(r["steps"][1])), float(r["severity"]), r["summary"], r.get("evidence") or {})
                event = r["event"]
            except (ValueError, KeyError, TypeError, IndexError):
                skipped += 1
                continue
            key = key_of(finding)
            if event == "start":
                self.tracker.open[key] = finding
                self.tracker.seen.add(key)
            elif event == "end":
                self.tracker.open.pop(key, None)
        if skipped:
            self.log(f"skipped {skipped} unreadable line(s) of {self.findings_path()}")
        if self.tracker.open:
            self.log(f"{len(self.tracker.open)} finding(s) still open from an earlier watcher of this run")

    def _send(self, event: str, finding: Finding, at_step: int) -> None:
        record = json_safe(dict(finding.to_dict(), event=event, at_step=int(at_step), time=now_iso(),
                                run_id=self.run_id))
        self.records.append(record)
        if self.metrics is not None and event == "start":
            self.metrics.announced(finding.kind)
        for sink in self._all_sinks():
            try:
                sink.send(record)
            except Exception as exc:  # a full disk or closed stdout: the other sinks still get it
                self.state.errors += 1
                if self.metrics is not None:
                    self.metrics.errors.inc()
                self.log(f"{type(sink).__name__} failed ({exc})")

    def _window_metrics(self, m: WatchMetrics, window, step: int) -> None:
        last = window.per_step[window.per_step.step == step]
        if len(last):
            row = last.iloc[0]
            m.throughput(float(row.step_time_s), float(row.tokens_per_s), float(row.mfu))
        for row in window.per_stage.itertuples():
            m.stage(int(row.pp), float(row.p50_s), float(row.max_s))
        m.open_findings(list(self.tracker.open.values()))

    def _start(self) -> ProgressFollower:
        """At the first tick: check the run opens (RunOpenError otherwise), start the metrics."""
        if self.follower is None:
            store = Store(self.path, threads=self.cfg.threads)
            self.run_id = str(store.manifest.get("run_id") or self.path.name)
            self.metrics = WatchMetrics(self.run_id)
            self.follower = ProgressFollower(self.path, store.manifest)
        return self.follower

    def _all_sinks(self) -> list[Any]:
        webhook = self.webhook  # read once: an HTTP change may swap it meanwhile
        return self.sinks + ([webhook] if webhook is not None else [])

    def reconfigure(self, cfg: WatchConfig) -> None:
        """Take `cfg` (window, webhook, settings changed over HTTP) from the next tick on. A new webhook
        replaces the old one, whose queued records are still delivered (its close runs aside)."""
        with self._changing:
            old_cfg, old_hook, self.cfg = self.cfg, self.webhook, cfg
            self.tracker.end_after = cfg.settings.detect.straggler.max_gap + 1
            if cfg.webhook != old_cfg.webhook:
                self.webhook = BackgroundSink("webhook", post_json(cfg.webhook), self.log) if cfg.webhook else None
                if old_hook is not None:
                    threading.Thread(target=old_hook.close, name="megascope-old-webhook", daemon=True).start()

    def findings_path(self) -> Path:
        return self.cfg.findings_file or self.path / rd.FINDINGS_FILE

    def _listing(self) -> tuple[frozenset, frozenset]:
        """(relative paths of the events and steps segments, (name, mtime) of the in-flight records)."""
        names: list[str] = []
        for table in ("events", "steps"):
            base = self.path / table
            if not base.is_dir():
                continue
            for folder in os.scandir(base):
                if folder.is_dir() and folder.name.startswith("rank="):
                    names.extend(f"{table}/{folder.name}/{f.name}" for f in os.scandir(folder.path)
                                 if f.name.endswith(".parquet") and not f.name.startswith("."))
        inflight: list[tuple[str, float]] = []
        records = rd.inflight_dir(self.path)
        if records.is_dir():
            inflight = [(f.name, f.stat().st_mtime) for f in os.scandir(records) if f.name.endswith(".json")]
        return frozenset(names), frozenset(inflight)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()
