"""`megascope watch`: a simulated run landing step by step, with an injected straggler, is reported
once when the straggler appears and once when it ends; the webhook (a real HTTP server on loopback)
and the --on-finding command receive the records; a dead webhook port does not hold the watcher; a
failing tick is survived; on the finished run the watcher's verdict equals `megascope analyze`'s."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import jsonschema
import pandas.testing as pd_testing
import pyarrow.compute as pc
import pytest

from megascope.analyzer import Run, build_report
from megascope.analyzer.data.summary_cache import is_current
from megascope.analyzer.findings import Finding
from megascope.analyzer.report.build import json_safe
from megascope.analyzer.watch import watcher as watch
from megascope.analyzer.watch.live_rows import LiveRows
from megascope.analyzer.watch.sinks import BackgroundSink, post_json
from megascope.analyzer.watch.tracker import Tracker
from megascope.analyzer.watch.watcher import WatchConfig, Watcher
from megascope.analyzer.watch.window import LiveStore, derive
from tests.watch_feed import Feeder, simulate_steps

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "report.schema.json").read_text())
FINDING = jsonschema.Draft202012Validator({"$defs": SCHEMA["$defs"], "$ref": "#/$defs/finding"})
ONSET = 8
RECORD_KEYS = {"event", "at_step", "time", "run_id"}


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory) -> Path:
    return simulate_steps(tmp_path_factory.mktemp("src") / "run", steps=20,
                          inject=[f"straggler:rank=5,slowdown=0.3,from={ONSET}"])


class Hook(BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Hook.received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def follow(feeder: Feeder, watcher: Watcher, per_poll: int = 1) -> None:
    """Land the run `per_poll` steps at a time, one watcher poll after each, until it says it is over."""
    for _ in range(feeder.total + 2):
        feeder.feed(per_poll)
        if watcher.poll():
            watcher.finish()
            return
    raise AssertionError("the watcher never saw the run finish")


def test_straggler_found_once_delivered_and_final_equals_analyze(straggler_run, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Hook.received = []
    marker = tmp_path / "commands.jsonl"
    command = f"{sys.executable} -c \"import sys; open(sys.argv[1], 'a').write(sys.stdin.read() + '\\n')\" {marker}"
    live = tmp_path / "live"
    watcher = Watcher(live, WatchConfig(webhook=f"http://127.0.0.1:{server.server_port}/hook", on_finding=command))
    try:
        follow(Feeder(straggler_run, live), watcher)
    finally:
        watcher.close()
        server.shutdown()
    lines = [json.loads(x) for x in (live / "findings.jsonl").read_text().splitlines()]
    assert lines == watcher.records
    starts = [r for r in lines if r["event"] == "start"]
    ends = [r for r in lines if r["event"] in ("end", "open_at_end")]
    assert [(r["kind"], r["ranks"]) for r in starts] == [("straggler", [5])]  # once, nothing else
    # the straggler holds to the last step: open at the end of the run, not ended
    assert [(r["event"], r["kind"], r["ranks"], r["steps"]) for r in ends] == [
        ("open_at_end", "straggler", [5], [ONSET, 19])]
    assert starts[0]["steps"][0] == ONSET and starts[0]["at_step"] <= ONSET + 3  # live, not at the end
    for record in lines:
        FINDING.validate({k: v for k, v in record.items() if k not in RECORD_KEYS})
    # the webhook and the command got every record, in order
    assert Hook.received == lines
    assert [json.loads(x) for x in marker.read_text().splitlines()] == lines
    # verdict on the finished run: what `megascope analyze` reports
    report = build_report(Run.open(live), with_what_if=False)
    final = [{k: v for k, v in r.items() if k not in RECORD_KEYS} for r in lines if r["event"] == "final"]
    assert final == json_safe(report["findings"]) and final
    # the persisted rank-step summary was kept up to date on the way
    assert is_current(Run.open(live).store)


def test_clean_run_reports_nothing(tmp_path):
    source = simulate_steps(tmp_path / "src", steps=16, seed=3)
    live = tmp_path / "live"
    watcher = Watcher(live, WatchConfig(summary=False))
    try:
        follow(Feeder(source, live), watcher, per_poll=4)
    finally:
        watcher.close()
    assert watcher.records == [] and watcher.state.errors == 0
    assert watcher.state.analyzed_step == 15


def test_dead_webhook_does_not_hold_the_watcher(straggler_run, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    live = tmp_path / "live"
    feeder = Feeder(straggler_run, live)
    feeder.feed(feeder.total)
    logged: list[str] = []
    watcher = Watcher(live, WatchConfig(webhook=f"http://127.0.0.1:{port}/", summary=False), log=logged.append)
    hook = watcher.webhook
    assert hook is not None
    assert watcher.poll()
    watcher.finish()
    # every record reached the file while the webhook thread was still retrying the first one
    assert [r["event"] for r in watcher.records] == ["start", "open_at_end", "final"]
    assert hook.delivered == 0
    watcher.close()
    assert hook.delivered == 0 and (hook.failed or any("not delivered" in m for m in logged))


def test_failing_tick_is_logged_counted_and_survived(straggler_run, tmp_path, monkeypatch):
    live = tmp_path / "live"
    feeder = Feeder(straggler_run, live)
    logged: list[str] = []
    watcher = Watcher(live, WatchConfig(summary=False), log=logged.append)
    real = watch.judge_window
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("disk hiccup")
        return real(*args, **kwargs)

    monkeypatch.setattr(watch, "judge_window", flaky)
    feeder.feed(ONSET + 6)
    assert not watcher.poll()
    assert watcher.state.errors == 1 and "disk hiccup" in logged[0] and "retrying in 1 s" in logged[0]
    watcher.state.retry_at = 0.0  # (the backoff has passed)
    assert not watcher.poll()  # analyzed again although no segment landed since
    assert [(r["event"], r["kind"]) for r in watcher.records] == [("start", "straggler")]
    watcher.close()


def test_tracker_announces_start_and_end_once():
    tracker = Tracker(end_after=4, hold=6)
    f = Finding("straggler", [5], ["h"], (8, 12), 1.3, "slow")
    assert [c.event for c in tracker.update([f], 12)] == ["start"]
    later = Finding("straggler", [5], ["h"], (8, 14), 1.3, "slow")
    assert tracker.update([later], 14) == []
    assert tracker.open[("straggler", (5,))].steps == (8, 14)
    assert tracker.update([later], 18) == []  # 4 steps behind: still open (gaps of noise)
    assert tracker.update([], 20) == []  # missed by the window, 6 behind: held (noise)
    ended = tracker.update([later], 21)
    assert [(c.event, c.finding.steps) for c in ended] == [("end", (8, 14))]
    assert tracker.update([], 22) == []
    # a new finding already 5 behind is no news
    assert tracker.update([Finding("straggler", [6], ["h"], (9, 17), 1.3, "slow")], 22) == []


def test_cli_refuses_bad_input(tmp_path):
    file = tmp_path / "not_a_dir"
    file.write_text("x")
    for args in ([str(file)], [str(tmp_path), "--poll", "0"], [str(tmp_path), "--webhook", "localhost:9"]):
        done = subprocess.run([sys.executable, "-m", "megascope", "watch", *args], check=False, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2, args
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("megascope watch: "), done.stderr
        assert done.stdout == ""


def test_cli_on_a_finished_run_prints_the_verdict_and_exits(straggler_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straggler_run, run)
    done = subprocess.run([sys.executable, "-m", "megascope", "watch", str(run), "--no-summary", "--poll", "0.2"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[2:5] for line in lines] == [["NEW", "straggler", "(steps"], ["OPEN", "AT", "END"],
                                                     ["FINAL", "straggler", "(steps"]]
    assert "run finished at step 19: 1 finding(s), 0 still open" in done.stderr
    assert len((run / "findings.jsonl").read_text().splitlines()) == 3


def test_ctrl_c_stops_cleanly(tmp_path):
    live = tmp_path / "live"  # no run.json yet: the watcher waits for the job to start
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "watch", str(live), "--poll", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "waiting for" in proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    finally:
        proc.kill()
    assert rc == 130
    err = proc.stderr.read()
    assert "stopped at step None" in err and "Traceback" not in err
    assert proc.stdout.read() == ""


def test_restarted_watcher_does_not_announce_again(straggler_run, tmp_path):
    live = tmp_path / "live"
    feeder = Feeder(straggler_run, live)
    first = Watcher(live, WatchConfig(summary=False))
    feeder.feed(ONSET + 5)
    first.poll()
    first.close()
    assert [(r["event"], r["kind"]) for r in first.records] == [("start", "straggler")]
    with (live / "findings.jsonl").open("a") as f:
        f.write("{not json\n")  # a torn line (a full disk): skipped, said once
    logged: list[str] = []
    second = Watcher(live, WatchConfig(summary=False), log=logged.append)
    follow(feeder, second)
    second.close()
    assert [r["event"] for r in second.records] == ["open_at_end", "final"]
    assert any("skipped 1 unreadable line" in m for m in logged)
    assert any("1 finding(s) still open" in m for m in logged)


def test_damaged_segment_is_survived(straggler_run, tmp_path):
    live = tmp_path / "live"
    feeder = Feeder(straggler_run, live)
    feeder.feed(ONSET + 5)
    (live / "steps" / "rank=00002" / "seg-999999.parquet").write_bytes(b"PAR1 truncated")
    watcher = Watcher(live, WatchConfig(summary=False), log=lambda m: None)
    follow(feeder, watcher)
    watcher.close()
    assert watcher.follower.unreadable == ["steps/rank=00002/seg-999999.parquet"]
    assert [(r["event"], r["kind"], r["ranks"]) for r in watcher.records] == [
        ("start", "straggler", [5]), ("open_at_end", "straggler", [5]), ("final", "straggler", [5])]


def test_webhook_retries_until_the_endpoint_answers():
    answers = iter([500, 503, 204])
    got: list[dict] = []

    class Flaky(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code = next(answers)
            if code == 204:
                got.append(body)
            self.send_response(code)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    logged: list[str] = []
    sink = BackgroundSink("webhook", post_json(f"http://127.0.0.1:{server.server_port}/"), logged.append,
                          first_delay_s=0.05)
    try:
        sink.send({"event": "start", "kind": "straggler"})
        sink.close(timeout_s=30)
    finally:
        server.shutdown()
    assert got == [{"event": "start", "kind": "straggler"}]
    assert (sink.delivered, sink.failed, logged) == (1, 0, [])


def test_live_rows_summarize_each_step_once_and_equal_the_event_pass(straggler_run, tmp_path):
    """The rows the watcher summarizes as the run lands, a few steps a tick, are the event pass's
    rank_step rows of the finished run, value for value (the detectors read the same table)."""
    live = tmp_path / "live"
    feeder = Feeder(straggler_run, live)
    rows = LiveRows(live, json.loads((straggler_run / "run.json").read_text()), keep=1000)
    lister = watch.SegmentLister(live)
    while feeder.next < feeder.total:
        feeder.feed(3)
        rows.add(lister.new())
        rows.summarize()
    assert lister.new() == [] and rows.late_rows == 0
    assert rows.done_through == feeder.steps[-1]
    store = LiveStore(live)
    derive(store, {name: rows.window(name, 0, rows.done_through) for name in rows.rows}, rows.base or 0)
    columns = "* EXCLUDE (host)"
    mine = store.query(f"SELECT {columns} FROM rank_step ORDER BY step, rank")
    truth = Run.open(live).rank_steps().drop(columns="host")
    assert len(mine) == len(feeder.steps) * 8
    pd_testing.assert_frame_equal(mine.reset_index(drop=True), truth.reset_index(drop=True), check_dtype=False)


def test_pinned_steps_outlive_the_pruning_and_are_held_once(straggler_run, tmp_path):
    """Steps pinned around an open finding's onset are held after the kept steps moved past them: a
    window over both holds each step once, with the rows it had while kept; unpinned, they go."""
    live = tmp_path / "live"
    feeder = Feeder(straggler_run, live)
    rows = LiveRows(live, json.loads((straggler_run / "run.json").read_text()), keep=4)
    lister = watch.SegmentLister(live)
    feeder.feed(6)
    rows.add(lister.new())
    rows.summarize()
    before = rows.window("edge_rank_step", 3, 4).sort_by([("step", "ascending"), ("rank", "ascending")])
    rows.pin([(3, 4)])
    while feeder.next < feeder.total:
        feeder.feed(3)
        rows.add(lister.new())
        rows.summarize()
    last = rows.done_through
    assert last == feeder.steps[-1] and rows.first_kept() == 3
    held = rows.window("edge_rank_step", 0, last)
    assert sorted(held["step"].to_pylist()) == sorted([3, 4, *range(last - 3, last + 1)] * 8)
    again = held.filter(pc.less_equal(held["step"], 4)).sort_by([("step", "ascending"), ("rank", "ascending")])
    assert again.equals(before)
    rows.pin([])
    assert rows.first_kept() == last - 3


def test_hang_is_announced_and_stays_open_when_the_run_goes_idle(tmp_path):
    source = simulate_steps(tmp_path / "src", dp=2, tp=2, pp=2, steps=12, inject=["hang:rank=5,at=6"])
    live = tmp_path / "live"
    feeder = Feeder(source, live)
    watcher = Watcher(live, WatchConfig(summary=False, idle_exit_s=1e-3), log=lambda m: None)
    feeder.feed(feeder.total)
    watcher.poll()
    assert watcher.records == []  # steps alone: no hang yet
    feeder.feed_inflight()  # the watchdogs' records of the stuck ops
    watcher.poll()
    assert [(r["event"], r["kind"], r["ranks"]) for r in watcher.records] == [("start", "hang", [5])]
    assert watcher.poll()  # nothing new lands: idle
    watcher.finish()
    watcher.close()
    # a hung run is not over: no 'end', the verdict is written and the hang stays open
    assert [r["event"] for r in watcher.records] == ["start", "final"]
    assert list(watcher.tracker.open) == [("hang", (5,))]


def test_a_watcher_over_its_judging_budget_judges_less_often_and_the_rest_before_the_verdict(straggler_run, tmp_path):
    """--judge-cpu: with a budget no judgement fits, the window is judged once at the first complete
    step, the steps after it only when the run is over (before the verdict): nothing is lost, latency is."""
    live = tmp_path / "live"
    watcher = Watcher(live, WatchConfig(summary=False, judge_cpu_s=1e-9), log=lambda m: None)
    follow(Feeder(straggler_run, live), watcher)
    watcher.close()
    assert watcher.state.ticks == 2 and watcher.state.summarized_step == watcher.state.analyzed_step == 19
    assert [(r["event"], r["kind"], r["at_step"], r["steps"]) for r in watcher.records] == [
        ("start", "straggler", 19, [ONSET, 19]), ("open_at_end", "straggler", 19, [ONSET, 19]),
        ("final", "straggler", 19, [ONSET, 19])]


def test_lister_finds_each_segment_once_in_write_order_and_odd_names(tmp_path):
    folder = tmp_path / "steps" / "rank=00003"
    folder.mkdir(parents=True)
    lister = watch.SegmentLister(tmp_path, full_every_s=3600)

    def land(*names: str) -> None:
        for name in names:
            (folder / name).write_bytes(b"")

    land("seg-000000.parquet", "seg-000001.parquet", "seg-999999.parquet", ".seg-000002.parquet.tmp")
    assert sorted(lister.new()) == [f"steps/rank=00003/{n}" for n in
                                    ("seg-000000.parquet", "seg-000001.parquet", "seg-999999.parquet")]
    assert lister.new() == []
    land("seg-000002.parquet", "seg-000003.parquet")  # probed by name: the odd one is not read again
    assert lister.new() == ["steps/rank=00003/seg-000002.parquet", "steps/rank=00003/seg-000003.parquet"]
    land("other.parquet")  # not the tracer's name: found by the next whole listing
    lister.full_every_s = 0
    assert lister.new() == ["steps/rank=00003/other.parquet"] and lister.new() == []
    lister.full_every_s = 3600
    assert lister.new() == []  # the rank folders as listed before
    later = tmp_path / "steps" / "rank=00004"  # a rank that starts late: its table's folder changed
    later.mkdir()
    (later / "seg-000000.parquet").write_bytes(b"")
    assert lister.new() == ["steps/rank=00004/seg-000000.parquet"] and lister.new() == []
