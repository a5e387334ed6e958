"""A running `megascope watch` process changed over its HTTP port on 127.0.0.1 without a restart: /status
says what it follows and how far behind it is; /settings reads the window, the webhook and every
detector threshold, and a POST changes them from the next tick: a threshold that hides a real straggler
and then lets it through, a webhook added mid-run that receives the records (a real HTTP server on
loopback). Bad changes are refused whole, in one line; a token, when given, guards every endpoint; an
address off loopback without a token is refused before anything is bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.test_watch_prometheus import free_port
from tests.watch_feed import Feeder, simulate_steps

pytestmark = pytest.mark.slow
ONSET = 8


class Hook(BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        Hook.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def call(port: int, path: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="GET" if body is None else "POST",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_for(what: str, done, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = done()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def start_watch(run: Path, port: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "watch", str(run), "--poll", "0.1", "--no-summary",
                             "--metrics-port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for("the watcher's HTTP port", lambda: proc.poll() is not None or _answers(port))
    assert proc.poll() is None, proc.communicate()[1]
    return proc


def _answers(port: int) -> bool:
    try:
        call(port, "/settings")
        return True
    except OSError:
        return False


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.terminate()
    return proc.communicate(timeout=60)[1]


def test_settings_status_and_webhook_change_while_it_runs(tmp_path):
    src = simulate_steps(tmp_path / "src", steps=24, inject=[f"straggler:rank=5,slowdown=0.3,from={ONSET}"])
    live, port = tmp_path / "live", free_port()
    live.mkdir()
    hook = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    Hook.received.clear()
    proc = start_watch(live, port)
    try:
        code, status = call(port, "/status")
        assert code == 200 and status["following"]["waiting_for_run_json"] is True
        assert status["following"]["run_dir"] == str(live) and status["progress"]["analyzed_step"] is None

        code, before = call(port, "/settings")
        assert code == 200 and before["window"] == 32 and before["webhook"] is None
        assert before["settings"]["detect"]["straggler"]["min_ratio"] == 1.03

        # refused whole, one line each: an unknown setting beside a good one, a bad window, a bad webhook
        for bad, says in [({"window": 16, "set": {"detect.straggler.no_such": 1}}, "no setting"),
                          ({"window": 0}, "window must be an integer >= 1"),
                          ({"webhook": "ftp://x"}, "webhook must be an http(s) URL"),
                          ({"threshold": 3}, "can change window, webhook, set")]:
            code, answer = call(port, "/settings", bad)
            assert code == 400 and says in answer["error"] and "\n" not in answer["error"], answer
        assert call(port, "/settings")[1] == before

        # a threshold no 30% straggler reaches: the run lands past its onset and nothing is announced
        code, after = call(port, "/settings", {"window": 16, "set": {"detect.straggler.min_ratio": 3,
                                                                     "detect.straggler.gross_ratio": 3}})
        assert code == 200 and after["window"] == 16
        assert after["settings"]["detect"]["straggler"]["min_ratio"] == 3.0
        feeder = Feeder(src, live)
        feeder.feed(ONSET + 6)
        status = wait_for("the watcher to catch up",
                          lambda: (s := call(port, "/status")[1])["progress"]["analyzed_step"] == ONSET + 5 and s)
        assert status["following"]["waiting_for_run_json"] is False and status["progress"]["world"] == 8
        assert status["open_findings"] == [] and status["behind"]["steps"] == 0 and status["ticks"] >= 1
        assert status["behind"]["pending_segments"] == 0 and status["behind"]["last_tick_lag_s"] >= 0
        spent = status["cpu_s"]  # where its CPU went: every phase ran, none counted twice
        assert set(spent) == {"listing", "reading", "summarizing", "judging"} and min(spent.values()) > 0
        assert status["polls"] >= status["ticks"] and sum(spent.values()) < status["uptime_s"] * os.cpu_count()

        # back to the defaults and a webhook added: the straggler is found and delivered, no restart
        code, _ = call(port, "/settings", {"webhook": f"http://127.0.0.1:{hook.server_port}/hook",
                                           "set": {"detect.straggler.min_ratio": 1.03,
                                                   "detect.straggler.gross_ratio": 2.0}})
        assert code == 200
        feeder.feed(2)
        wait_for("the straggler at the webhook", lambda: any(r["kind"] == "straggler" for r in Hook.received))
        started = [r for r in Hook.received if r["event"] == "start"]
        assert [(r["kind"], r["ranks"]) for r in started] == [("straggler", [5])], Hook.received
        status = wait_for("the open finding", lambda: (s := call(port, "/status")[1])["open_findings"] and s)
        assert [(f["kind"], f["ranks"]) for f in status["open_findings"]] == [("straggler", [5])]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'megascope_straggler_score{kind="straggler",rank="5"}' in metrics
    finally:
        err = stop(proc)
        hook.shutdown()
    assert "settings changed over HTTP" in err


def test_token_guards_every_endpoint(tmp_path):
    (tmp_path / "live").mkdir()
    secret = tmp_path / "token"
    secret.write_text("s3cret-token\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "watch", str(tmp_path / "live"), "--poll", "0.1",
                             "--metrics-port", str(port), "--token-file", str(secret)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the HTTP port", lambda: proc.poll() is not None or _answers(port))
        for path in ("/status", "/settings", "/metrics"):
            assert call(port, path)[0] == 401
            assert call(port, path, token="wrong")[0] == 401
        assert call(port, "/settings", {"window": 8})[0] == 401
        assert call(port, "/settings", token="s3cret-token")[1]["window"] == 32
        assert call(port, "/settings", {"window": 8}, token="s3cret-token")[1]["window"] == 8
    finally:
        stop(proc)


def test_off_loopback_without_a_token_is_refused_before_binding(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megascope", "watch", str(tmp_path), "--metrics-port", "0",
                           "--bind", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "--token-file" in done.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    done = subprocess.run([sys.executable, "-m", "megascope", "watch", str(tmp_path), "--metrics-port", "0",
                           "--token-file", str(empty)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "expected one secret" in done.stderr
