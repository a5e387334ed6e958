"""`megascope watch RUN`: live diagnosis beside a running job.

Each poll looks for the segments that landed since the last one (listing.SegmentLister: one stat per
rank folder) and the in-flight records; when there are any, one tick:
1. reads the new segments only, learns how far each rank got, and summarizes the rank-steps that are
   complete now, once each (live_rows.LiveRows: per-rank state, the edge macros the tracers run);
2. when the last summarized step advanced, extends the persisted rank-step summary from the new steps
   only (summary_cache.py), so the dashboard's heatmap is current, and (also when hang records
   appeared) runs the default detectors over the last `window` summarized steps (window.judge_window:
   from the summaries, not the events) - every step while a judgement costs at most `judge_cpu_s` of
   CPU per step of the job, every few steps past that (a 12,288-rank window takes seconds);
3. compares those findings with the open ones (tracker.Tracker), dates a new one whose onset is the
   window's first step from the kept summaries before the window (its true onset), and sends each
   start and end to the sinks (sinks.py: stdout, RUN/findings.jsonl, webhook, command), updates the
   metrics.
When the run is finished (every rank recorded run.json's last step) or has been idle for
`idle_exit_s`, the watcher runs the full analysis (what `megascope analyze` finds), announces what the
windows missed, ends what no longer holds, reports what still held at the last step as open at the
end, writes each final finding ('final' records), then stops.
A tick that fails is logged, counted and retried with backoff; the watcher keeps going.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
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
from megascope.analyzer.watch.listing import SegmentLister
from megascope.analyzer.watch.live_rows import LiveRows, Progress
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
from megascope.analyzer.watch.window import LiveStore, WindowResult, analyze_full, judge_window
from megascope.tracer import run_dir as rd

CPU_PHASES = ("listing", "reading", "summarizing", "judging")
"""Where a watcher's CPU goes (WatchState.cpu_s, /status): the polls' look for new segments and in-flight
records; taking the new segments in (LiveRows.add); summarizing complete steps (LiveRows.summarize, the
heatmap's summary included); judging windows (the detectors, the onset look-up, the pins)."""
MAX_RETRY_S = 60.0
"""A tick that keeps failing is retried at most this far apart (not every poll: the log stays readable)."""
LOOKBACK_WINDOWS = 3
"""Summarized steps kept before the window, in windows: a new finding whose onset is the window's first
step is judged again over them, for its true onset (a 3x straggler seen 67 steps after its onset, with
a 32-step window, was announced as 'since step 96' instead of 60)."""


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
    judge_cpu_s: float = 0.5
    """CPU seconds per step of the job the detectors may take: a window is judged every step while a
    judgement costs at most this, else every ceil(cost / judge_cpu_s) steps (--judge-cpu)."""
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
    """The last step of the last window judged."""
    summarized_step: int | None = None
    """The last step summarized (LiveRows.done_through)."""
    judge_cpu_s: float = 0.0
    """CPU seconds of the last judgement."""
    cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CPU_PHASES, 0.0))
    """CPU seconds spent so far (the whole process's, DuckDB's threads included) per phase, CPU_PHASES."""
    polls: int = 0
    inflight: frozenset = frozenset()
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
        self.tracker = Tracker(end_after=self.cfg.settings.detect.straggler.max_gap + 1, hold=self.cfg.window // 2,
                               network_hold=4 * self.cfg.window)
        self.state = WatchState()
        self.metrics: WatchMetrics | None = None
        self.follower: LiveRows | None = None
        self.lister = SegmentLister(self.path)
        self._pending: list[str] = []
        """Segments listed and not yet taken in by a tick."""
        self._store: LiveStore | None = None
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
        with self._spent("listing"):
            self._pending += self.lister.new()
            inflight = self._inflight()
        self.state.polls += 1
        now = time.monotonic()
        changed = bool(self._pending) or inflight != self.state.inflight
        self.state.pending = len(self._pending) + (inflight != self.state.inflight)
        if self.state.pending and self.state.pending_since is None:
            self.state.pending_since = now
        if changed:
            self.state.changed_at = now
        if (changed or self.state.failing) and now >= self.state.retry_at:
            try:
                self.tick(inflight)
            except RunOpenError:
                raise
            except Exception as exc:  # a tick never kills the watcher: logged, counted, retried
                self.state.errors += 1
                self.state.failing += 1  # tried again after a backoff, new segments or not
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

    def tick(self, inflight: frozenset) -> None:
        rows = self._start()
        new, self._pending = self._pending, []
        with self._spent("reading"):
            rows.add(new)  # taken in, whatever happens next: a retry must not add them twice
        progress = rows.progress()
        self.state.progress = progress
        m = self.metrics
        assert m is not None  # _start() has set it
        m.dropped.set(progress.dropped_events)
        m.finished.set(1 if progress.finished else 0)
        cfg = self.cfg  # one tick, one config: a change over HTTP takes effect from the next tick
        rows.keep, rows.keep_collectives = cfg.window * (1 + LOOKBACK_WINDOWS), 2 * cfg.window
        with self._spent("summarizing"):
            step = rows.summarize(final=progress.finished)
        hang_changed = inflight != self.state.inflight
        if step is None or (step == self.state.analyzed_step and not hang_changed):
            return
        if step != self.state.summarized_step:
            self.state.summarized_step = step
            m.step_advanced(step)
            if self.cfg.summary:  # the dashboard's heatmap: extended from the new steps only
                with self._spent("summarizing"):
                    Run.open(self.path, threads=self.cfg.threads).refresh_summary()
        if not hang_changed and not self._judge_due(step):
            return
        cpu = time.process_time()
        since = self.state.analyzed_step
        first = self._first_step(step)
        store = self._live_store(bool(inflight))
        window = judge_window(store, rows, first, step, cfg.settings)
        found = self._true_onsets(store, window.findings, first, step)
        self.state.analyzed_step, self.state.inflight = step, inflight
        for change in self.tracker.update(found, step, since):
            self._send(change.event, change.finding, change.at_step)
        quarter = cfg.window // 4  # _first_step's reach before an onset
        rows.pin([(f.steps[0] - quarter, f.steps[0] + quarter) for f in self.tracker.open.values() if f.kind != "hang"])
        self.state.judge_cpu_s = time.process_time() - cpu
        self.state.cpu_s["judging"] += self.state.judge_cpu_s
        self._window_metrics(m, window, step)
        m.ticks.inc()
        steps_new = sorted((p for p in new if p.startswith("steps/")), key=lambda p: p.rsplit("/", 1)[-1])
        self.state.lag_s = max(0.0, time.time() - max((_mtime(self.path / p) for p in steps_new[-64:]),
                                                      default=time.time()))
        m.lag.set(self.state.lag_s)
        self.state.ticks, self.state.last_tick_at = self.state.ticks + 1, time.monotonic()

    @contextlib.contextmanager
    def _spent(self, phase: str) -> Iterator[None]:
        """Adds the CPU seconds of the block to state.cpu_s[phase] (also when it raises)."""
        cpu = time.process_time()
        try:
            yield
        finally:
            self.state.cpu_s[phase] += time.process_time() - cpu

    def _first_step(self, step: int) -> int:
        """The judged window's first step: `window` steps back, or, while a finding is open, from a
        quarter window before its onset (as far as the held summaries reach: the steps around an open
        finding's onset are pinned, LiveRows.pin; the window then skips from them to the kept ones). A
        window wholly inside a straggler's episode shows the rank slow from its first step, which the
        detector holds to a stricter test (z_start): judged that way a 2.5x straggler came and went 3
        times in 90 steps."""
        first = step - self.cfg.window + 1
        if self.state.analyzed_step is not None:  # every step since the last judgement, with context: a
            # flush lands 30-50 steps at once, and an episode wholly between two windows went unseen
            first = min(first, self.state.analyzed_step + 1 - self.cfg.window // 4)
        onsets = [f.steps[0] for f in self.tracker.open.values() if f.kind != "hang"]
        kept = self.follower.first_kept() if self.follower is not None else None
        if onsets and kept is not None:
            first = min(first, max(kept, min(onsets) - self.cfg.window // 4))
        return max(first, kept) if kept is not None else first

    def _judge_due(self, step: int) -> bool:
        """Whether the window ending at `step` is judged now: the steps since the last judgement times
        judge_cpu_s pay for what the last one cost."""
        last = self.state.analyzed_step
        return last is None or (step - last) * self.cfg.judge_cpu_s >= self.state.judge_cpu_s

    def _live_store(self, hang_records: bool) -> LiveStore:
        """The store the windows are judged on, made once (again when in-flight records come or go:
        only a hang's report opens the events)."""
        if self._store is None or self._store.with_events != hang_records:
            if self._store is not None:
                self._store.con.close()
            self._store = LiveStore(self.path, threads=self.cfg.threads, events=hang_records)
        return self._store

    def _true_onsets(self, store: LiveStore, found: list[Finding], first: int, step: int) -> list[Finding]:
        """`found`, where a finding not open yet may have begun before the window: the same finding of
        the detectors over the kept summaries before the window, when they date it earlier (its summary
        then says so too). Every new finding is looked up, not only one dated at the window's first step:
        a window wholly inside an episode may place a noise shift a few steps in as its onset (a 3x
        straggler from step 60 announced "since step 89" in a window from step 85, 1 run in 7)."""
        rows = self.follower
        kept = rows.first_kept() if rows is not None else None
        last = self.state.analyzed_step  # the step judged before this window (the tracker's `since`)
        fresh = min(step, last if last is not None else step) - self.tracker.end_after  # older: no news
        clipped = [f for f in found
                   if key_of(f) not in self.tracker.open and f.kind != "hang" and f.steps[1] >= fresh]
        if rows is None or kept is None or kept >= first or not clipped:
            return found
        wider = judge_window(store, rows, kept, step, self.cfg.settings)
        earlier = {key_of(f): f for f in wider.findings}
        out = []
        for f in found:
            w = earlier.get(key_of(f)) if f in clipped else None
            if w is not None and w.steps[0] < f.steps[0]:
                f = Finding(w.kind, w.ranks, w.hosts, (w.steps[0], max(w.steps[1], f.steps[1])), w.severity,
                            w.summary, w.evidence)
            out.append(f)
        return out

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
        if self.follower is not None and self.state.summarized_step != self.state.analyzed_step:
            self.state.judge_cpu_s = 0.0  # the steps --judge-cpu left unjudged: judged now, before the verdict
            self.tick(self.state.inflight)
        progress = self.state.progress
        finished = progress is not None and progress.finished
        step = self.state.analyzed_step if self.state.analyzed_step is not None else -1
        if finished and progress is not None and progress.complete_step is not None:
            step = progress.complete_step
        final = analyze_full(self.path, self.cfg.threads, self.cfg.settings)
        for f in final:
            if key_of(f) not in self.tracker.seen:  # the windows missed it (e.g. a slow trend)
                self._send("start", f, step)
                self.tracker.open[key_of(f)] = f
                self.tracker.seen.add(key_of(f))
        if finished:
            for change in self.tracker.close_at_end(step):
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
        if self.follower is not None:
            self.follower.close()
        if self._store is not None:
            self._store.con.close()
            self._store = None
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
            if event in ("start", "update"):
                self.tracker.open[key] = finding
                self.tracker.seen.add(key)
            elif event in ("end", "open_at_end"):
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

    def _window_metrics(self, m: WatchMetrics, window: WindowResult, step: int) -> None:
        last = window.per_step[window.per_step.step == step]
        if len(last):
            row = last.iloc[0]
            m.throughput(float(row.step_time_s), float(row.tokens_per_s), float(row.mfu))
        for row in window.per_stage.itertuples():
            m.stage(int(row.pp), float(row.p50_s), float(row.max_s))
        m.open_findings(list(self.tracker.open.values()))

    def _start(self) -> LiveRows:
        """At the first tick: check the run opens (RunOpenError otherwise), start the metrics."""
        if self.follower is None:
            store = Store(self.path, threads=self.cfg.threads)
            self.run_id = str(store.manifest.get("run_id") or self.path.name)
            self.metrics = WatchMetrics(self.run_id)
            self.follower = LiveRows(self.path, store.manifest, self.cfg.window * (1 + LOOKBACK_WINDOWS),
                                     2 * self.cfg.window)
        return self.follower

    def _all_sinks(self) -> list[Any]:
        webhook = self.webhook  # read once: an HTTP change may swap it meanwhile
        return self.sinks + ([webhook] if webhook is not None else [])

    def reconfigure(self, cfg: WatchConfig) -> None:
        """Take `cfg` (window, webhook, settings changed over HTTP) from the next tick on. A new webhook
        replaces the old one, whose queued records are still delivered (its close runs aside)."""
        with self._changing:
            old_cfg, old_hook, self.cfg = self.cfg, self.webhook, cfg
            self.tracker.end_after, self.tracker.hold = cfg.settings.detect.straggler.max_gap + 1, cfg.window // 2
            self.tracker.network_hold = 4 * cfg.window
            if cfg.webhook != old_cfg.webhook:
                self.webhook = BackgroundSink("webhook", post_json(cfg.webhook), self.log) if cfg.webhook else None
                if old_hook is not None:
                    threading.Thread(target=old_hook.close, name="megascope-old-webhook", daemon=True).start()

    def findings_path(self) -> Path:
        return self.cfg.findings_file or self.path / rd.FINDINGS_FILE

    def _inflight(self) -> frozenset:
        """(name, mtime) of the in-flight records (RUN/inflight: the watchdogs' stuck ops)."""
        records = rd.inflight_dir(self.path)
        if not records.is_dir():
            return frozenset()
        return frozenset((f.name, f.stat().st_mtime) for f in os.scandir(records) if f.name.endswith(".json"))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()
